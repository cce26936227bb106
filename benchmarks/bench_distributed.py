"""Distributed calibration (issue 16): MiniLM calibration wall time on 1 and 2 processes.

One thread per process (``torch.set_num_threads(1)``); the 2-process runs are two gloo ranks
forked from this process after capture, each calibrating its contiguous shard
(``quantkit.shard``) with ``quantkit.calibrate``, which ends with the exact observer reduction
(``quantkit.observers.sync``). Times are wall-clock, from a barrier to the end of
``calibrate`` on the slower rank; the reduction is timed inside the ranks, from a barrier
(waiting for the slower rank is not counted) to the end of each sync. Also checks that
the 2-process qparams equal the 1-process ones (``torch.equal``).

With ``--gptq``: W8A8 with GPTQ weight rounding (minmax activations) instead, where the
reduction also sums each block's Hessians before it is rounded; "equal" is then the share of
GPTQ-rounded weights equal to the 1-process ones (documented: >= 99.9 %).

    python benchmarks/bench_distributed.py [--sentences 128] [--batch-size 8] [--seq-len 128] [--gptq]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.quantizers import QuantConfig, W8A8Quantizer  # noqa: E402

OBSERVERS = ["minmax", "moving_average_minmax", "mse", "kl"]
WORLD = 2


GPTQ = "minmax+gptq"


def _prepare(gm, act):
    if act == GPTQ:
        return quantkit.prepare(gm, W8A8Quantizer(QuantConfig(weight_algorithm="gptq")))
    return quantkit.prepare(gm, W8A8Quantizer(QuantConfig(act_observer=act)))


def _rounded(prepared) -> dict:
    from quantkit import _graph
    from quantkit.accuracy.rounding import _base as _rounding

    return {lin.node.name: _graph.get_attr(prepared, lin.weight).detach().clone()
            for lin in _rounding.find_rounded_linears(prepared)}


def _equal(one: dict, two: dict) -> str:
    """qparams all torch.equal (True/False); with GPTQ weights, the share of equal weights too."""
    same = all(all(torch.equal(a, b) for a, b in zip(one["qparams"][n], two["qparams"][n])) for n in one["qparams"])
    if not one.get("weights"):
        return str(same)
    eq = sum(int((one["weights"][n] == two["weights"][n]).sum()) for n in one["weights"])
    total = sum(w.numel() for w in one["weights"].values())
    return f"{same}; weights {eq / total:.4%}"


def _qparams(prepared) -> dict:
    return {n: [torch.as_tensor(t).clone() for t in m.calculate_qparams()]
            for n, m in prepared.named_modules()
            if n and isinstance(m, quantkit.observers.QuantkitObserver) and not m.is_dynamic and m.calibrated}


def _rank(rank: int, port: int, gm, data, out: str, observers: list) -> None:
    import torch.distributed as dist

    from quantkit.observers import _sync

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    inner, spent = _sync.sync_observers, []

    def timed(*a, **k):
        dist.barrier()  # untimed: the wait for the slower rank is not the reduction's cost
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent.append(time.perf_counter() - t)

    _sync.sync_observers = timed  # sync and GPTQ's Hessian sync look it up at call time
    res = {}
    for act in observers:
        prepared = _prepare(gm, act)
        mine = quantkit.shard(data)
        dist.barrier()
        spent.clear()
        t = time.perf_counter()
        quantkit.calibrate(prepared, mine, progress=False)
        res[act] = {"wall": time.perf_counter() - t, "sync": sum(spent), "qparams": _qparams(prepared),
                    "weights": _rounded(prepared)}
    torch.save(res, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--gptq", action="store_true", help="W8A8 with GPTQ weight rounding instead")
    args = ap.parse_args()
    observers = [GPTQ] if args.gptq else OBSERVERS
    torch.set_num_threads(1)
    model, tok = _hf.load_hf_model(_hf.default_model_path(), progress=False)
    sents = _hf.read_sentences(_hf.default_calibration_file())[:args.sentences]
    data = _hf.tokenize(tok, sents, seq_len=args.seq_len, batch_size=args.batch_size)
    gm = quantkit.capture(model, data[0], dynamic_shapes=_hf.dynamic_shapes(data[0]))
    one = {}
    for act in observers:
        prepared = _prepare(gm, act)
        t = time.perf_counter()
        quantkit.calibrate(prepared, data, progress=False)
        one[act] = {"wall": time.perf_counter() - t, "qparams": _qparams(prepared), "weights": _rounded(prepared)}
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, port, gm, data, f"{tmp}/r{r}.pt", observers)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        ranks = [torch.load(f"{tmp}/r{r}.pt", weights_only=True) for r in range(WORLD)]
    n_obs = len(one[observers[0]]["qparams"])
    print(f"MiniLM calibration: {len(data)} batches of {args.batch_size} x <= {args.seq_len} tokens, "
          f"{n_obs} observers, 1 thread per process, gloo; torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| activation observer | 1 process (s) | 2 processes (s) | speedup | reduction (ms) | reduction share | "
          "qparams equal |")
    print("|---|---|---|---|---|---|---|")
    for act in observers:
        wall2 = max(r[act]["wall"] for r in ranks)
        sync_ms = max(r[act]["sync"] for r in ranks) * 1e3
        equal = " / ".join(_equal(one[act], r[act]) for r in ranks)
        print(f"| {act} | {one[act]['wall']:.2f} | {wall2:.2f} | {one[act]['wall'] / wall2:.2f}x | {sync_ms:.1f} | "
              f"{sync_ms / 1e3 / wall2:.1%} | {equal} |")


if __name__ == "__main__":
    main()
