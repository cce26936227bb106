"""torchrun with the default recipe (``--recipe auto``) gives the artifact one process gives (issue 28).

The recipe search runs on every rank before the process group exists, and chooses by latency; a
rank that timed its own kernels under the other rank's load could choose another recipe than rank 0
or than one process. So every latency is rank 0's, handed over torchrun's agent store
(``pipeline/_distributed.rank0_value``), and timed with the thread count one process has. The unit
tests drive that exchange through a real TCPStore with torchrun's environment; the end-to-end test
runs ``torchrun --nproc-per-node 2`` (gloo) on the tests' MLP and compares every tensor of the two
artifacts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import quantkit
from quantkit._errors import DistributedError
from quantkit.accuracy import _costmodel, _latency
from quantkit.pipeline import _distributed
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs
from tests.models import make_transformer

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent(monkeypatch):
    """torchrun's environment around a real TCPStore standing in for its agent store; ``as_rank(r)``
    makes this process rank ``r`` of 2 (a fresh store client and request count)."""
    port = _port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))

    def as_rank(rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(_distributed, "_AGENT", [])
        monkeypatch.setattr(_distributed, "_ASKED", {})

    yield as_rank
    del server


def test_other_ranks_take_rank_0s_values(agent):
    agent(0)
    assert _distributed.rank0_value("a", lambda: 1.5) == 1.5
    assert _distributed.rank0_value("a", lambda: 2.5) == 2.5  # the second request for a name is its own value
    agent(1)
    computed = []
    assert _distributed.rank0_value("a", lambda: computed.append(1) or 9.0) == 1.5
    assert _distributed.rank0_value("a", lambda: computed.append(1) or 9.0) == 2.5
    assert computed == []


def test_a_rank_waiting_for_rank_0_stops_when_rank_0_failed(agent, monkeypatch):
    agent(0)
    _distributed.mark_failed_early(0)
    agent(1)
    with pytest.raises(DistributedError, match=r"^rank 0 of 2 failed before calibration; see its error"):
        _distributed.rank0_value("never sent", lambda: 1.0)


def test_a_rank_waiting_for_a_silent_rank_0_times_out_in_one_line(agent, monkeypatch):
    monkeypatch.setenv("QUANTKIT_DIST_TIMEOUT", "0.3")
    agent(1)
    with pytest.raises(DistributedError, match=r"^rank 0 of 2 sent no latency within 0.3 s .*QUANTKIT_DIST_TIMEOUT"):
        _distributed.rank0_value("never sent", lambda: 1.0)


def test_meter_on_rank_1_uses_rank_0s_kernel_timings(agent, tmp_path, monkeypatch):
    """Rank 1's own timer (and cache) would give other numbers; its estimates are rank 0's."""
    model, x = make_transformer()
    gm = quantkit.capture(model, (x,))
    q = quantkit.quantize(gm, (x,), [(x,)], W8A8Quantizer(QuantConfig()), progress=False)
    # the kernel set of an AVX2-only CPU: VNNI adds per-token kernels, native BF16 bf16 GEMMs
    from quantkit.lowering import _bf16, _onednn

    for mod in (_costmodel, _latency, _onednn):
        monkeypatch.setattr(mod, "exact_on_this_cpu", lambda: False)
    for mod in (_costmodel, _latency, _bf16):
        monkeypatch.setattr(mod, "bf16_supported", lambda: False)
    estimates = {}
    for rank, ms in ((0, 1.0), (1, 5.0)):
        agent(rank)
        monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / f"cache{rank}"))
        monkeypatch.setattr(_costmodel, "time_kernel", lambda fn, threads, ms=ms: ms)
        meter = _latency.Meter(gm, (x,))
        estimates[rank] = (meter.int8(q, "static"), meter.floats(model)["fp32_ms"], dict(meter.kernel_timings))
    assert estimates[1][:2] == estimates[0][:2]
    assert estimates[0][2] == {"measured": 7} and estimates[1][2] == {"rank 0": 7}
    assert not (tmp_path / "cache1" / "latency.json").exists()  # rank 1 timed and stored nothing


def test_timings_use_one_process_thread_count_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # what torchrun's OMP_NUM_THREADS=1 gives a rank
    assert _latency.timing_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _latency.timing_threads() == 1


def _artifact_tensors(out: Path) -> tuple[dict, dict, str]:
    doc = json.loads((out / "quantization.json").read_text())
    state = quantkit.load(out).state_dict()
    return doc, state, json.loads((out / "report.json").read_text())["autotune"]["chosen"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux")
def test_torchrun_default_recipe_equals_one_process(tmp_path):
    from quantkit.cli import main

    weights, calib = write_mlp_inputs(tmp_path, calib_rows=40)  # 5 batches of 8: 2 and 3 per rank
    env = dict(os.environ, HF_HUB_OFFLINE="1", QUANTKIT_DIST_TIMEOUT="120")
    env.pop("OMP_NUM_THREADS", None)  # torchrun's default, 1 per rank
    two = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_port()), "-m", "quantkit",
                           *mlp_quantize_args(weights, calib, two)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = tmp_path / "one"
    assert main(mlp_quantize_args(weights, calib, one)) == 0  # the same latency cache (conftest's)
    (doc1, state1, chosen1), (doc2, state2, chosen2) = _artifact_tensors(one), _artifact_tensors(two)
    assert chosen1 == chosen2
    assert doc1["recipe"] == doc2["recipe"]
    assert [(t["node"], t["scale"], t["zero_point"]) for t in doc1["tensors"]] == \
           [(t["node"], t["scale"], t["zero_point"]) for t in doc2["tensors"]]
    assert state1.keys() == state2.keys() and len(state1) >= 4
    differ = [k for k in state1 if not torch.equal(state1[k], state2[k])]
    assert not differ, f"{len(differ)} of {len(state1)} tensors differ: {differ[:5]}"
