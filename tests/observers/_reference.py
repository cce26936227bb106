"""Plain per-candidate references for the histogram searches (one candidate at a time)."""

import numpy as np
from scipy.stats import entropy


def kl_reference(hist, start: int, stop: int, levels: int) -> float:
    """KL(P‖Q) of the window hist[start:stop], as TensorRT/MXNet entropy calibration
    computes it: tails folded into the window's end bins, the window quantized to
    ``levels`` groups of ``len // levels`` bins (the last group takes the remainder),
    each group's mass spread over the bins where P is non-zero."""
    h = np.asarray(hist, dtype=np.float64)
    window = h[start:stop]
    p = window.copy()
    p[0] += h[:start].sum()
    p[-1] += h[stop:].sum()
    m = len(window) // levels
    group = np.minimum(np.arange(len(window)) // m, levels - 1)
    mass = np.bincount(group, weights=window, minlength=levels)
    nonzero = np.bincount(group, weights=(p != 0).astype(np.float64), minlength=levels)
    q = np.where(p != 0, (mass / np.maximum(nonzero, 1))[group], 0.0)
    return float(entropy(p, q))


def kl_threshold_reference(abs_hist, levels: int = 128) -> int:
    """TensorRT's loop: the stop bin (threshold = stop · bin width) with the smallest KL."""
    n = len(abs_hist)
    kls = [kl_reference(abs_hist, 0, i, levels) for i in range(levels, n + 1)]
    return levels + int(np.argmin(kls))


def mse_threshold_reference(abs_hist, amax: float, quant_max: int = 127) -> float:
    """ModelOpt-style MSE calibration: for each bin edge as threshold, fake-quantize the
    bin centres (symmetric int8) and take the count-weighted squared error."""
    h = np.asarray(abs_hist, dtype=np.float64)
    n = len(h)
    centres = (np.arange(n) + 0.5) * amax / n
    errs = []
    for i in range(1, n + 1):
        t = i * amax / n
        s = t / (quant_max + 0.5)
        fq = np.clip(np.round(centres / s), -quant_max - 1, quant_max) * s
        errs.append(float((h * (centres - fq) ** 2).sum()))
    return (1 + int(np.argmin(errs))) * amax / n


def mse_amax_torch_loop(abs_hist, amax: float, quant_max: int = 127, start_bin: int = 128) -> float:
    """The MSE calibration loop of NVIDIA's pytorch-quantization / ModelOpt
    (``_compute_amax_mse``), as those libraries run it: torch ops, one candidate at a
    time, candidates at the bin centres from ``start_bin`` on, scale ``amax / quant_max``,
    bin centres fake-quantized and weighted by their counts, one host read per candidate."""
    import torch

    counts = torch.as_tensor(abs_hist, dtype=torch.float32)
    edges = torch.linspace(0, amax, len(counts) + 1, dtype=torch.float32)
    centers = (edges[1:] + edges[:-1]) / 2
    mses = []
    for i in range(start_bin, len(centers)):
        scale = centers[i] / quant_max
        fq = torch.round(centers / scale).clamp(-quant_max - 1, quant_max) * scale
        mses.append(float(((fq - centers) ** 2 * counts).mean()))
    return float(centers[start_bin + int(np.argmin(mses))])
