"""Plain per-candidate references for the histogram searches (one candidate at a time),
and the test distributions."""

import numpy as np
import torch
from scipy.stats import entropy


def sample(name: str, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` float32 values of a test distribution (fixed seed): ``"gaussian"``,
    ``"laplace"`` or ``"student_t"`` (3 degrees of freedom: heavy tails)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    if name == "gaussian":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif name == "laplace":
        x = -torch.sign(u - 0.5) * torch.log1p(-2 * (u - 0.5).abs())
    elif name == "student_t":
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).pow(2).sum(0)
        x = z / torch.sqrt(chi2 / 3)
    else:
        raise ValueError(f"unknown test distribution {name!r}")
    return x.float()


def kl_reference(hist, start: int, stop: int, levels: int) -> float:
    """KL(P‖Q) of the window hist[start:stop] as TensorRT's entropy calibration builds it
    (NVIDIA pytorch-quantization ``_compute_amax_entropy``), with the mass left of the
    window added to its first bin as the mass right of it is added to its last: bin b of
    the window goes to level ``digitize(b, linspace(0, len, levels + 1)) - 1``; Q spreads
    each level's mass over the level's bins where the histogram is non-zero."""
    h = np.asarray(hist, dtype=np.float64)
    window = h[start:stop]
    p = window.copy()
    p[0] += h[:start].sum()
    p[-1] += h[stop:].sum()
    n = len(window)
    level = np.digitize(np.arange(n), np.linspace(0, n, levels + 1)) - 1
    level[window == 0] = -1
    kept = level >= 0
    mass = np.bincount(level[kept], weights=window[kept], minlength=levels)
    count = np.bincount(level[kept], minlength=levels)
    q = np.zeros(n)
    q[kept] = mass[level[kept]] / count[level[kept]]
    return float(entropy(p, q))


def tensorrt_entropy_amax(x, num_bits: int = 8, unsigned: bool = False, num_bins: int = 2048,
                          start_bin: int = 128) -> float:
    """TensorRT's entropy calibration of the raw values ``x``, as NVIDIA's
    pytorch-quantization does it (``HistogramCalibrator.collect`` on all of ``x`` at once,
    then ``_compute_amax_entropy``): a ``num_bins``-bin histogram of ``|x|`` over
    ``[0, max|x|]`` (here ``np.histogram``), then :func:`tensorrt_entropy_bin`. Returns
    the bin edge ``edges[i]`` (pytorch-quantization's ``calib_bin_edges[i]``; not the bin
    centre ``(i + 0.5)·width`` of the GTC 2017 slides, half a bin apart)."""
    a = np.abs(np.asarray(x, dtype=np.float64)).ravel()
    hist, edges = np.histogram(a, bins=num_bins, range=(0.0, float(a.max())))
    return float(edges[tensorrt_entropy_bin(hist, num_bits, unsigned, start_bin)])


def tensorrt_entropy_bin(hist, num_bits: int = 8, unsigned: bool = False, start_bin: int = 128) -> int:
    """``_compute_amax_entropy``'s choice on the ``|x|`` counts ``hist``: the ``i`` of the
    last smallest of :func:`tensorrt_entropy_divergences`."""
    kl = tensorrt_entropy_divergences(hist, num_bits, unsigned, start_bin)
    return start_bin + len(kl) - 1 - int(np.argmin(kl[::-1]))


def tensorrt_entropy_divergences(hist, num_bits: int = 8, unsigned: bool = False,
                                 start_bin: int = 128) -> np.ndarray:
    """``_compute_amax_entropy``'s loop on the ``|x|`` counts ``hist``: bin 0 takes bin 1's
    count; for each ``i = start_bin .. len(hist)``: P = the first ``i`` bins with the rest
    added to bin ``i − 1``, Q = those bins merged into ``2^(num_bits − 1 + unsigned)``
    levels (``np.digitize`` on ``np.linspace(0, i, levels + 1)``) and spread back over
    their non-zero bins, ``KL = scipy.stats.entropy(P, Q)``. Returns the KLs, one per ``i``.

    The candidates are built one at a time; ``entropy`` runs on blocks of them at once
    (``axis=1``: each row normalised on its own, as one call per candidate would)."""
    bins = np.array(hist, dtype=np.int64)
    bins[0] = bins[1]
    n = len(bins)
    levels = 1 << (num_bits - 1 + int(unsigned))
    candidates = list(range(start_bin, n + 1))
    kl = np.empty(len(candidates))
    block = 256
    for b0 in range(0, len(candidates), block):
        rows = candidates[b0:b0 + block]
        p = np.zeros((len(rows), n))
        q = np.zeros((len(rows), n))
        for r, i in enumerate(rows):
            level = np.digitize(np.arange(i), np.linspace(0, i, num=levels + 1)) - 1
            level[bins[:i] == 0] = -1
            kept = level >= 0
            mass = np.bincount(level[kept], weights=bins[:i][kept], minlength=levels)
            count = np.bincount(level[kept], minlength=levels)
            q[r, :i][kept] = mass[level[kept]] / count[level[kept]]
            p[r, :i] = bins[:i]
            p[r, i - 1] += bins[i:].sum()
        kl[b0:b0 + len(rows)] = entropy(p, q, axis=1)
    return kl


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
