"""GPTQ on the chain of blocks: block by block from safetensors (quantize_pretrained) and in memory.

References: the in-memory path (``quantkit.quantize`` on the loaded model) for the sequential
path, and the prefix re-run (one pass over the model's prefix per GPTQ block, the algorithm
the in-memory path used before it cached each block's inputs) for the in-memory path.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import quantkit
from quantkit.accuracy.rounding import _gptq, _gptq_blocks
from quantkit.sequential import _run as _sequential
from quantkit.sequential._run import quantize_pretrained
from quantkit.quantizers import QuantConfig, W8A8Quantizer, WeightOnlyQuantizer

transformers = pytest.importorskip("transformers")

from tests.test_sequential import _assert_same_model, _batches, _bert, _in_memory, _llama, _logits  # noqa: E402

GPTQ = W8A8Quantizer(QuantConfig(weight_algorithm="gptq"))
INT4_GPTQ = dict(bits=4, group_size=16, algorithm="gptq")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": _llama(root / "llama"), "bert": _bert(root / "bert")}


@pytest.fixture(scope="module")
def llama_in_memory(checkpoints):
    return _in_memory(checkpoints["llama"], _batches("llama"), GPTQ)


@pytest.fixture(scope="module")
def llama_int4_in_memory(checkpoints):
    return _in_memory(checkpoints["llama"], _batches("llama"), WeightOnlyQuantizer(**INT4_GPTQ))


def _state(model) -> dict:
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}


def _rtn_differs(path, batches, gptq_model) -> int:
    rtn = _in_memory(path, batches, W8A8Quantizer()).state_dict()
    return sum(not torch.equal(v, rtn[k]) for k, v in gptq_model.state_dict().items() if v.dtype == torch.int8)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_sequential_gptq_equals_in_memory(checkpoints, llama_in_memory, kind, monkeypatch):
    path, batches = checkpoints[kind], _batches(kind)
    spilled: list[bool] = []
    real_put = _sequential.ActivationCache.put

    def put(self, block, i, values):  # the rounded stream is a second cache, under <partial>/gptq
        spilled.append("gptq" in str(self.root))
        return real_put(self, block, i, values)

    monkeypatch.setattr(_sequential.ActivationCache, "put", put)
    # a 4 KiB budget: both streams are read back from disk
    seq = quantize_pretrained(path, batches, GPTQ, sequential=True, max_memory=4096, progress=False)
    ref = llama_in_memory if kind == "llama" else _in_memory(path, batches, GPTQ)
    _assert_same_model(seq, ref, seq.meta["quantkit_qparams"], ref.meta["quantkit_qparams"])
    assert any(spilled) and not all(spilled)
    # GPTQ really rounded: most int8 weights differ from round-to-nearest's
    assert _rtn_differs(path, batches, ref) >= 6
    assert torch.equal(_logits(seq, batches[0]), _logits(ref, batches[0]))


# weight-only (group-wise observers): int4 rounded by GPTQ, written as an artifact; NF4 to nearest, in memory
@pytest.mark.parametrize("kind,kwargs,write", [("llama", INT4_GPTQ, True),
                                               ("bert", dict(bits=4, group_size=16, scheme="nf4"), False)])
def test_sequential_weight_only_equals_in_memory(checkpoints, llama_int4_in_memory, kind, kwargs, write, tmp_path):
    path, batches = checkpoints[kind], _batches(kind)
    quantizer = WeightOnlyQuantizer(**kwargs)
    seq = quantize_pretrained(path, batches, quantizer, sequential=True, max_memory=4096, progress=False,
                              out=tmp_path / "out" if write else None)
    records = seq.meta["quantkit_qparams"] if not write else \
        json.loads((tmp_path / "out" / "quantization.json").read_text())["tensors"]
    if write:
        seq = quantkit.load(tmp_path / "out")
    ref = llama_int4_in_memory if kind == "llama" else _in_memory(path, batches, quantizer)
    got, want = _state(seq), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert sum(v.dtype == torch.uint8 for v in want.values()) >= 13  # packed 4-bit weights: Llama 15, BERT 13
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert [r["node"] for r in records] == [r["node"] for r in ref.meta["quantkit_qparams"]]
    assert all(r["algorithm"] == kwargs.get("algorithm", "rtn") for r in records)
    assert torch.equal(_logits(seq, batches[0]), _logits(ref, batches[0]))


def test_fp8_weights_are_refused_before_any_block_runs(checkpoints, tmp_path):
    from quantkit.quantizers import FP8Quantizer

    with pytest.raises(quantkit.QuantkitError, match=r"quantized by \w+ \(float8_e4m3fn\), which block-by-block "):
        quantize_pretrained(checkpoints["llama"], _batches("llama"), FP8Quantizer(), out=tmp_path / "o",
                            sequential=True, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_gptq_run_resumes_to_the_same_artifact(checkpoints, llama_int4_in_memory, tmp_path, monkeypatch):
    """int4 GPTQ: its group qparams are GPTQ's own choice, which the resumed run restores."""
    path, out, quantizer = checkpoints["llama"], tmp_path / "out", WeightOnlyQuantizer(**INT4_GPTQ)
    monkeypatch.setenv(_sequential.KILL_AFTER_ENV, "1")  # interrupted once head and layer 0 are rounded

    def killed(pid, sig):
        raise KeyboardInterrupt

    monkeypatch.setattr(_sequential.os, "kill", killed)
    with pytest.raises(KeyboardInterrupt):
        quantize_pretrained(path, _batches("llama"), quantizer, out=out, sequential=True, progress=False)
    partial = _sequential.PartialDir.beside(out)
    assert json.loads((partial / "state.json").read_text())["done"] == 1
    assert (partial / "gptq" / "acts" / "0001").is_dir()  # layer 0's rounded outputs
    monkeypatch.delenv(_sequential.KILL_AFTER_ENV)
    ran: list[int] = []
    real = _sequential._Run._load_weights
    monkeypatch.setattr(_sequential._Run, "_load_weights", lambda self, b: (ran.append(b.index), real(self, b)))
    quantize_pretrained(path, _batches("llama"), quantizer, out=out, sequential=True, resume=True, progress=False)
    assert ran == [2, 3] and not partial.exists()
    loaded, ref = _state(quantkit.load(out)), llama_int4_in_memory.state_dict()
    assert sorted(loaded) == sorted(ref) and all(torch.equal(loaded[k], v) for k, v in ref.items())
    tensors = json.loads((out / "quantization.json").read_text())["tensors"]
    assert tensors == llama_int4_in_memory.meta["quantkit_qparams"]  # group-wise records: scales are tensors


def test_in_memory_gptq_runs_each_block_once(checkpoints, llama_in_memory, monkeypatch):
    """Each block: one Hessian pass per GPTQ group in it, one rounded forward to hand on; the
    weights and qparams are those of the prefix re-run."""
    path, batches = checkpoints["llama"], _batches("llama")
    passes: list[tuple[int, str]] = []
    real_hessians, real_call = _gptq_blocks.RoundedBlock.hessians, _gptq_blocks.RoundedBlock.__call__

    def hessians(self, sources, n, get, masks):
        passes.extend([(self.block.index, "hessian")] * n)
        return real_hessians(self, sources, n, get, masks)

    def call(self, values):
        passes.append((self.block.index, "forward"))
        return real_call(self, values)

    monkeypatch.setattr(_gptq_blocks.RoundedBlock, "hessians", hessians)
    monkeypatch.setattr(_gptq_blocks.RoundedBlock, "__call__", call)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    blocks = quantkit.quantize(model, batches[0], batches, GPTQ, progress=False)
    n = len(batches)
    # head (no GPTQ linear): forward only; layers: one Hessian pass + forward; tail (lm_head): one pass
    assert passes == [(0, "forward")] * n + [(1, "hessian")] * n + [(1, "forward")] * n + \
        [(2, "hessian")] * n + [(2, "forward")] * n + [(3, "hessian")] * n
    assert len(blocks.meta.get("quantkit_qparams", [])) > 0
    monkeypatch.setattr(_gptq, "run_gptq", _gptq.run_gptq_prefix)
    prefix = quantkit.quantize(model, batches[0], batches, GPTQ, progress=False)
    _assert_same_model(blocks, prefix, blocks.meta["quantkit_qparams"], prefix.meta["quantkit_qparams"])
    _assert_same_model(blocks, llama_in_memory, blocks.meta["quantkit_qparams"],
                       llama_in_memory.meta["quantkit_qparams"])


def test_in_memory_gptq_falls_back_without_a_chain(monkeypatch):
    """A graph with no repeated unit (an MLP) is rounded by the prefix re-run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    data = [torch.randn(4, 16) for _ in range(3)]
    used: list[str] = []
    real = _gptq.run_gptq_prefix
    monkeypatch.setattr(_gptq, "run_gptq_prefix", lambda *a, **k: (used.append("prefix"), real(*a, **k))[1])
    q = quantkit.quantize(model, data[0], data, GPTQ, progress=False)
    assert used == ["prefix"]
    assert sum(v.dtype == torch.int8 for v in q.state_dict().values()) == 2


def test_cli_sequential_gptq(checkpoints, tmp_path, monkeypatch):
    from quantkit.cli import main

    rounded: list[str] = []
    real = _gptq.round_linears
    monkeypatch.setattr(_gptq, "round_linears",
                        lambda lins, h, block, *a: (rounded.append(block), real(lins, h, block, *a))[1])
    monkeypatch.setattr(_gptq_blocks, "round_linears", _gptq.round_linears)

    calib = tmp_path / "calib"
    calib.mkdir()
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        torch.save(torch.randint(0, 96, (5 + i,), generator=g), calib / f"s{i}.pt")
    out = tmp_path / "out"
    args = ["quantize", str(checkpoints["llama"]), "--calib", str(calib), "--out", str(out), "--batch-size", "2",
            "--sequential", "--scheme", "w4a16", "--group-size", "16", "--algorithm", "gptq", "--quiet"]
    assert main(args) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["source"]["sequential"] is True
    linears = [t for t in doc["tensors"] if t.get("kind") == "weight" and "-> linear" in t["node"]]
    assert len(linears) == 15 and all(t["algorithm"] == "gptq" and t["dtype"] == "uint4" for t in linears)
    assert rounded == ["model.layers.0", "model.layers.1", "lm_head"]  # every linear's group, block by block
    assert os.path.isfile(out / "model.pt2")
