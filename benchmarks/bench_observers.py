"""Calibration observers (issue 3): histogram update and range-search speed against
torchao and the per-candidate references, MiniLM calibration time and accuracy.

Run from the repository root:

    python benchmarks/bench_observers.py            # everything, prints a Markdown section
    python benchmarks/bench_observers.py --no-model # synthetic tensors only
    python benchmarks/bench_observers.py --kl-only --kl-seeds 40 --kl-before 0452f6b  # KL tables only

All timings of one table come from the same run on the same tensors (ratios side by
side). Threads default to 1: on a shared 2-core machine, intra-op threads make small
ops wait on each other and the numbers stop meaning anything.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for tests.observers._reference

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchao.quantization.pt2e.observer import HistogramObserver as TorchaoHistogram  # noqa: E402

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.observers import HistogramObserver  # noqa: E402
from quantkit.observers import _histsearch as hs  # noqa: E402
from quantkit.observers import _rangesearch as rs  # noqa: E402
from quantkit.quantizers import QuantConfig, W8A8Quantizer  # noqa: E402
from tests.observers._reference import (  # noqa: E402
    mse_amax_torch_loop,
    mse_threshold_reference,
    sample,
    tensorrt_entropy_amax,
    tensorrt_entropy_bin,
)

SYM = dict(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
AFF = dict(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
METHODS = ("kl", "mse", "l2", "percentile")


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except Exception:
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"


def _timeit(fn, repeat: int = 5) -> float:
    """Median seconds of ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _activations(batches: int, seed: int = 0) -> list[torch.Tensor]:
    """Activation-like tensors, 32×128×384: Gaussian bulk, a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(384)
    scale[torch.randperm(384, generator=g)[:6]] = 12.0  # outlier channels, as in transformers
    return [torch.randn(32, 128, 384, generator=g) * scale + 0.1 for _ in range(batches)]


def bench_update(xs) -> list[str]:
    ours = {"affine": HistogramObserver(**AFF), "symmetric": HistogramObserver(**SYM),
            "kl, affine (131072 bins)": HistogramObserver(method="kl", **AFF),
            "kl, symmetric (131072 bins)": HistogramObserver(method="kl", **SYM)}
    theirs = TorchaoHistogram(bins=2048)
    per = {name: [] for name in ("torchao", *ours)}
    for x in xs:
        for name, obs in (("torchao", theirs), *ours.items()):
            t0 = time.perf_counter()
            obs(x)
            per[name].append(time.perf_counter() - t0)
    ta = statistics.median(per["torchao"][1:])
    rows = ["| observer | median update per batch | vs torchao |", "|---|---:|---:|",
            f"| torchao HistogramObserver (2048 bins) | {ta * 1e3:.1f} ms | 1.00× |"]
    for name in ours:
        t = statistics.median(per[name][1:])
        rows.append(f"| quantkit HistogramObserver, {name} | {t * 1e3:.1f} ms | {ta / t:.2f}× faster |")
    return rows


def bench_search(xs) -> list[str]:
    theirs = TorchaoHistogram(bins=2048)
    for x in xs:
        theirs(x)
    # medians of many calls (a search is ~0.3 ms: 9 samples right after the update phase
    # still include cache warm-up); the per-candidate references run 3 times each
    t_torchao = _timeit(theirs.calculate_qparams, 20)
    rows = ["| method | scheme | search + qparams | vs torchao's calculate_qparams | vs per-candidate reference |",
            "|---|---|---:|---:|---:|"]
    refs = {}
    for scheme_name, scheme in (("symmetric", SYM), ("affine", AFF)):
        for method in METHODS:
            obs = HistogramObserver(method=method, **scheme)
            for x in xs:
                obs(x)
            t = _timeit(obs.calculate_qparams, 50)
            ref = ""
            if scheme_name == "symmetric" and method in ("kl", "mse"):
                lo, hi = float(obs.min_val), float(obs.max_val)
                if method == "kl":  # TensorRT's loop on the 2048 |x| bins the search runs on
                    h, h_lo, h_hi = obs.occupied_bins()
                    view, z, _ = hs.kl_view(rs.host(h), h_lo, h_hi, lo, hi, obs.bins)
                    ah = hs.abs_view(view, z, obs.bins)
                    ref_fn = lambda: tensorrt_entropy_bin(ah)  # noqa: E731
                else:
                    ah, amax = hs.abs_histogram(obs.histogram[None], obs.min_val.double().view(1),
                                                obs.max_val.double().view(1))
                    ref_fn = lambda: mse_threshold_reference(ah[0].numpy(), float(amax))  # noqa: E731
                refs[method] = _timeit(ref_fn, 3)
                ref = f"{refs[method] / t:.0f}× faster ({refs[method]:.3f} s)"
                if method == "mse":
                    t_loop = _timeit(lambda: mse_amax_torch_loop(ah[0].numpy(), float(amax)), 3)
                    ref += f"; torch loop: {t_loop / t:.0f}× faster ({t_loop:.3f} s)"
            rows.append(f"| {method} | {scheme_name} | {t * 1e3:.2f} ms | {t_torchao / t:.1f}× faster | {ref} |")
    rows.append(f"| torchao HistogramObserver (L2, greedy) | affine | {t_torchao * 1e3:.1f} ms | 1.0× | |")
    return rows


def observers_at(rev: str):
    """The ``observers`` package as of git revision ``rev``, imported under another name
    (for before/after tables in one process)."""
    import importlib
    import tempfile

    root = Path(__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout
    name = "observers_" + git("rev-parse", "--short", rev).strip()
    pkg = Path(tempfile.mkdtemp()) / name
    pkg.mkdir()
    for path in git("ls-tree", "--name-only", rev, "observers/").split():
        (pkg / Path(path).name).write_text(git("show", f"{rev}:{path}"))
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module(name)


def bench_kl_fidelity(seeds: int, versions: dict, n: int = 200_000) -> list[str]:
    """The KL observer's threshold (symmetric int8, data in 4 batches) against TensorRT's
    entropy calibration run on the raw values (``tensorrt_entropy_amax``), per seed, for
    each ``{label: HistogramObserver class}``."""
    head = " | ".join(f"{v}: within 3% | {v}: median / worst deviation" for v in versions)
    rows = [f"| distribution | seeds | {head} |", "|---|---:|" + "---:|---:|" * len(versions)]
    for dist in ("gaussian", "laplace", "student_t"):
        errs = {v: [] for v in versions}
        for seed in range(seeds):
            x = sample(dist, n, seed)
            trt = tensorrt_entropy_amax(x.numpy())
            for v, cls in versions.items():
                obs = cls(method="kl", **SYM)
                for c in x.chunk(4):
                    obs(c)
                errs[v].append(abs(float(obs._min_max()[1]) - trt) / trt)
        cells = " | ".join(f"{sum(e <= 0.03 for e in es)}/{seeds} | {100 * statistics.median(es):.2f}% / "
                           f"{100 * max(es):.1f}%" for es in errs.values())
        rows.append(f"| {dist} | {seeds} | {cells} |")
        print(rows[-1], file=sys.stderr)
    return rows


def bench_kl_affine_search(seeds: int = 8, bins: int = 256) -> list[str]:
    """The affine KL search's pick against every window containing 0 (``bins`` bins a side,
    small enough to try them all) on two-signed data: 5 families x ``seeds`` seeds."""
    cases = []
    for seed in range(seeds):
        shift = float(torch.rand(1, generator=torch.Generator().manual_seed(100 + seed))) * 2 - 0.5
        cases += [(d, sample(d, 100_000, seed) + shift) for d in ("gaussian", "laplace", "student_t")]
        cases.append(("gelu", torch.nn.functional.gelu(sample("gaussian", 100_000, seed) * (1 + seed))))
        skew = torch.where(sample("gaussian", 100_000, seed + 50) > 0, 1.0, 0.2 + 0.1 * seed)
        cases.append(("skewed student_t", sample("student_t", 100_000, seed) * skew))
    excess = []
    for _, x in cases:
        obs = HistogramObserver(method="kl", bins=bins, **AFF)
        for c in x.chunk(4):
            obs(c)
        (h, h_lo, h_hi), lo, hi = obs.occupied_bins(), float(obs.min_val), float(obs.max_val)
        a, b = hs.search_kl(rs.host(h), h_lo, h_hi, lo, hi, obs._qp(), bins)
        view, z, w = hs.kl_view(rs.host(h), h_lo, h_hi, lo, hi, bins)
        view[z] = view[z + 1]
        tables = hs._KLTables(view, 256, 2 * bins)
        s, e = (v.reshape(-1) for v in torch.meshgrid(torch.arange(z + 1), torch.arange(z, view.size + 1), indexing="ij"))
        s, e = s[e - s >= hs.KL_START_BIN].numpy(), e[e - s >= hs.KL_START_BIN].numpy()
        best = min(float(hs.kl_divergence(tables, s[i:i + 20_000], e[i:i + 20_000]).min()) for i in range(0, s.size, 20_000))
        pick = hs.kl_divergence(tables, np.array([z + round(a / w)]), np.array([z + round(b / w)]))[0]
        excess.append(float(pick) / best - 1)
    excess.sort()
    return ["| cases | pick within 1% of the best window | within 2% | median excess | worst excess |",
            "|---:|---:|---:|---:|---:|",
            f"| {len(excess)} | {sum(v <= 0.01 for v in excess)} | {sum(v <= 0.02 for v in excess)} | "
            f"{100 * statistics.median(excess):.2f}% | {100 * excess[-1]:.0f}% |"]


def _cpu_per_call(fn, calls: int) -> float:
    """Process CPU seconds per call of ``fn`` (one thread): other jobs on a shared machine
    make the wall clock wait, not this."""
    fn()
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls


def bench_kl_speed(xs, versions: dict, blocks: int = 10) -> list[str]:
    """KL search and update per version, in alternating blocks (10 searches, or one update
    per batch), CPU time per call, median over blocks."""
    small = [x[:, :20].contiguous() for x in xs]  # short sentences: the per-update fixed cost
    rows = ["| KL observer (CPU time per call) | " + " | ".join(versions) + " |", "|---|" + "---:|" * len(versions)]
    for scheme_name, scheme in (("symmetric", SYM), ("affine", AFF)):
        obs = {v: cls(method="kl", **scheme) for v, cls in versions.items()}
        for x in xs:
            for o in obs.values():
                o(x)
        per = {v: [] for v in versions}
        for _ in range(blocks):
            for v, o in obs.items():
                per[v].append(_cpu_per_call(o.calculate_qparams, 10))
        rows.append(f"| search + qparams, {scheme_name} | "
                    + " | ".join(f"{statistics.median(t) * 1e3:.2f} ms" for t in per.values()) + " |")
        for label, data in (("32×128×384", xs), ("32×20×384", small)):
            per = {v: [] for v in versions}
            for _ in range(max(1, blocks // 5)):
                for v, cls in versions.items():
                    o = cls(method="kl", **scheme)
                    o(data[0])  # first batch: allocation
                    for x in data[1:]:
                        t0 = time.process_time()
                        o(x)
                        per[v].append(time.process_time() - t0)
            rows.append(f"| update, {scheme_name}, {label} batch | "
                        + " | ".join(f"{statistics.median(t) * 1e3:.2f} ms" for t in per.values()) + " |")
    return rows


def bench_minilm(seq_len: int, padding: str = "max_length", n_calib: int = 128,
                 n_test: int = 100, act_observers=None) -> tuple[list[str], list[str]]:
    """``padding="longest"`` pads each batch to its longest sentence and captures the
    sequence dimension as dynamic (what ``quantkit quantize`` does), so the observers see
    far fewer padding tokens than with every batch padded to ``seq_len``."""
    model, tok = _hf.load_hf_model(_hf.default_model_path())
    sentences = _hf.read_sentences(_hf.default_calibration_file())
    calib = _hf.tokenize(tok, sentences[:n_calib], seq_len=seq_len, batch_size=32, padding=padding)
    test = _hf.tokenize(tok, sentences[-n_test:], seq_len=seq_len, batch_size=32, padding=padding)
    with torch.no_grad():
        ref = torch.cat([_hf.embed(model(**b), b["attention_mask"]) for b in test])
    dyn = _hf.dynamic_shapes(calib[0]) if padding == "longest" else None
    gm = quantkit.capture(model, calib[0], dynamic_shapes=dyn)
    real = sum(int(b["attention_mask"].sum()) for b in calib)
    total = sum(b["attention_mask"].numel() for b in calib)
    shape = f"{seq_len} tokens" if padding == "max_length" else "longest in batch"
    print(f"calibration tokens: {real} real of {total} ({100 * real / total:.1f}%)", file=sys.stderr)
    rows_time = [f"| activation observer | calibration time (4 batches × 32 × {shape}) | vs min-max |",
                 "|---|---:|---:|"]
    rows_acc = ["| activation observer | weight observer | mean cosine | min cosine |", "|---|---|---:|---:|"]
    t_minmax = None
    acts = ("minmax", "kl", "mse", "l2", "percentile") if act_observers is None else act_observers
    configs = [(a, "per_channel_minmax") for a in dict.fromkeys(("minmax", *acts))]  # min-max: the time ratio
    if act_observers is None:
        configs += [("mse", "per_channel_mse")]
    warm = quantkit.prepare(copy.deepcopy(gm), W8A8Quantizer(QuantConfig(act_observer="mse")))
    quantkit.calibrate(warm, calib[:1], progress=False)  # first-call costs, untimed
    for act, weight in configs:
        cfg = QuantConfig(act_observer=act, weight_observer=weight)
        prepared = quantkit.prepare(copy.deepcopy(gm), W8A8Quantizer(cfg))  # prepare edits its input
        t0 = time.perf_counter()
        quantkit.calibrate(prepared, calib, progress=False)
        t_cal = time.perf_counter() - t0
        t0 = time.perf_counter()
        q = quantkit.convert(prepared)
        t_conv = time.perf_counter() - t0
        with torch.no_grad():
            emb = torch.cat([_hf.embed(q(**b), b["attention_mask"]) for b in test])
        cos = _hf.cosine(ref, emb)
        if weight == "per_channel_minmax":
            if act == "minmax":
                t_minmax = t_cal
            rows_time.append(f"| {act} | {t_cal:.2f} s (convert {t_conv:.2f} s) | {t_cal / t_minmax:.2f}× |")
        rows_acc.append(f"| {act} | {weight} | {float(cos.mean()):.5f} | {float(cos.min()):.5f} |")
        print(rows_acc[-1], file=sys.stderr)
    return rows_time, rows_acc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--no-model", action="store_true", help="skip the all-MiniLM-L6-v2 part")
    ap.add_argument("--seq-len", type=int, default=128, help="MiniLM tokens per sentence (padded)")
    ap.add_argument("--padding", choices=("max_length", "longest"), default="max_length",
                    help="MiniLM batches padded to --seq-len, or to their longest sentence "
                         "(dynamic sequence length, as `quantkit quantize` does)")
    ap.add_argument("--skip-synthetic", action="store_true", help="only the all-MiniLM-L6-v2 part")
    ap.add_argument("--kl-seeds", type=int, default=10, help="seeds per distribution for the KL-vs-TensorRT table")
    ap.add_argument("--kl-only", action="store_true", help="only the KL tables (TensorRT agreement, speed)")
    ap.add_argument("--kl-before", metavar="REV", default=None,
                    help="KL tables: also the observers of git revision REV, side by side")
    ap.add_argument("--act-observers", nargs="+", default=None,
                    help="MiniLM rows: these activation observers (and min-max) only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = ["## Calibration observers (issue 3)", "",
           f"Machine: {_machine()}. Date: {datetime.date.today()}.",
           f"Command: `python benchmarks/bench_observers.py {' '.join(sys.argv[1:] if argv is None else argv)}`.", ""]
    if args.kl_only or not args.skip_synthetic:
        versions = {"now": HistogramObserver}
        if args.kl_before:
            versions = {f"before ({args.kl_before})": observers_at(args.kl_before).HistogramObserver, **versions}
        out += [f"### KL threshold vs TensorRT's entropy calibrator ({args.kl_seeds} seeds, 200k samples)", ""]
        out += bench_kl_fidelity(args.kl_seeds, versions)
        out += ["", "### Affine KL search against every window (two-signed data, 256 bins a side)", ""]
        out += bench_kl_affine_search()
        if args.kl_before:
            out += ["", f"### KL search and update, side by side ({args.batches} batches of 32×128×384)", ""]
            out += bench_kl_speed(_activations(args.batches), versions)
        out += [""]
    if args.kl_only:
        print("\n".join(out))
        return
    if not args.skip_synthetic:
        xs = _activations(args.batches)
        out += [f"### Histogram update ({args.batches} batches of 32×128×384 float32, 2048 bins; KL 64x finer)", ""]
        out += bench_update(xs)
        out += ["", "### Range search + qparams (same histograms, 2048 bins)", ""]
        out += bench_search(xs)
    if not args.no_model:
        rows_time, rows_acc = bench_minilm(args.seq_len, args.padding, act_observers=args.act_observers)
        out += ["", "### all-MiniLM-L6-v2: calibration time (W8A8, weights per-channel min-max)", ""]
        out += rows_time
        out += ["", "### all-MiniLM-L6-v2: cosine to float on 100 held-out sentences "
                f"(calibrated on the first 128, padded to "
                f"{args.seq_len if args.padding == 'max_length' else 'the longest in each batch, at most ' + str(args.seq_len)} tokens)", ""]
        out += rows_acc
    print("\n".join(out))


if __name__ == "__main__":
    main()
