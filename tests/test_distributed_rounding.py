"""SmoothQuant, AWQ and GPTQ under two gloo processes (issue 16), against one process on all
the batches (the equivalences documented in ``quantkit.accuracy.rounding._sync``):

- SmoothQuant (fixed α and ``"auto"``): the smoothed model is ``torch.equal`` to one process's;
- AWQ: the scaled, clipped weights and their qparams are ``torch.equal`` to one process's;
- GPTQ (W8A8 and weight-only int4): every rank holds the same weights, whose integers equal one
  process's on ≥ 99.9 % of the weights; the synced Hessian is exactly one process merging the
  ranks' Hessian observers in rank order;
- a rank that fails makes both fail with one line each.

One start of two forked ranks serves every test (tiny two-block model, 8 batches, 2048 rows
per rank: rank 0's shard fills AWQ's and SmoothQuant's row samples).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import quantkit
from quantkit import _graph
from quantkit.accuracy.rounding import _base as _rounding
from quantkit.observers import HessianObserver
from quantkit.observers._sync import sync_observers
from quantkit.quantizers import QuantConfig, W8A8Quantizer, WeightOnlyQuantizer
from tests.models import TransformerBlock, TwoBlockNet
from tests.test_distributed import WORLD, _one_thread, _torchrun, run_ranks  # noqa: F401 (_one_thread: autouse fixture)

pytestmark = pytest.mark.skipif(not dist.is_available() or not hasattr(os, "fork"),
                                reason="needs torch.distributed (gloo) and fork")


def _model_and_data():
    torch.manual_seed(0)
    model = TwoBlockNet().eval()
    with torch.no_grad():
        model.layers[0].ln.weight[5] = 20.0  # an outlier channel for AWQ and SmoothQuant
    g = torch.Generator().manual_seed(1)
    # growing scales: rank 1's shard (batches 4..7) has other ranges than rank 0's
    data = [torch.randn(16, 32, 32, generator=g) * (1 + 0.25 * i) for i in range(8)]
    return model, data


SCHEMES = {
    "w8a8_gptq": lambda: W8A8Quantizer(QuantConfig(weight_algorithm="gptq")),
    "int4_gptq": lambda: WeightOnlyQuantizer(group_size=16, algorithm="gptq"),
    "int4_awq": lambda: WeightOnlyQuantizer(group_size=16, algorithm="awq"),
}


def _rounded(prepared) -> dict:
    """Per rounded linear: its weight and its observer's qparams."""
    out = {}
    for lin in _rounding.find_rounded_linears(prepared):
        scale, zp = lin.observer.calculate_qparams()
        out[lin.node.name] = [_graph.get_attr(prepared, lin.weight).detach().clone(),
                              torch.as_tensor(scale).clone(), torch.as_tensor(zp).clone()]
    return out


def _quantize(model, data, scheme, distributed):
    gm = quantkit.capture(model, (data[0],))
    prepared = quantkit.prepare(gm, SCHEMES[scheme]())
    quantkit.calibrate(prepared, data, progress=False, distributed=distributed)
    return prepared


def _attention_model():
    """A transformer block: AWQ scores its q/k/v scales on whole batches (``BatchSample``),
    which the ranks merge; 8 batches of 512 rows, 2048 kept (``AWQConfig.block_rows``)."""
    torch.manual_seed(3)
    model = TransformerBlock(d=32, heads=4).eval()
    with torch.no_grad():
        model.ln1.weight[7] = 15.0
    return model


def _hessians(batches) -> HessianObserver:
    h = HessianObserver()
    for x in batches:
        h(x)
    return h


def _hessian_batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randn(40, 24, generator=g) * (i + 1) + 0.1 * i for i in range(5)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    def work(rank: int) -> dict:
        model, data = _model_and_data()
        mine = quantkit.shard(data)
        res: dict = {}
        for alpha in (0.5, "auto"):
            res[f"smooth/{alpha}"] = quantkit.smooth_quant(model, mine, alpha=alpha).state_dict()
        res["smooth/local"] = quantkit.smooth_quant(model, mine, alpha=0.5, distributed=False).state_dict()
        res["int4_awq/local"] = _rounded(_quantize(model, mine, "int4_awq", False))
        attn = _quantize(_attention_model(), mine, "int4_awq", "auto")
        res["int4_awq/attention"] = _rounded(attn)
        res["int4_awq/attention/loss"] = [r["loss"] for r in attn.meta[_rounding.ROUNDING_META_KEY]]
        res["int4_awq/attention/local"] = _rounded(_quantize(_attention_model(), mine, "int4_awq", False))
        for scheme in SCHEMES:
            prepared = _quantize(model, mine, scheme, "auto")
            res[scheme] = _rounded(prepared)
            res[f"{scheme}/rows"] = torch.tensor([r.get("rows", -1) for r in prepared.meta[_rounding.ROUNDING_META_KEY]])
        # Hessians fed directly: rank 1 sees 3 batches, rank 0 2
        h = _hessians(quantkit.shard(_hessian_batches()))
        sync_observers([h])
        res["hessian"] = [h.xtx.clone(), h.rows.clone()]
        # a "cat" buffer synced twice: rows in rank order, then only the new rows, every bit kept
        from quantkit.accuracy.rounding._sync import _Carrier

        first = torch.tensor([[0.0, -0.0]]) if rank == 0 else torch.tensor([[1.0, 1.0], [1.0, -0.0]])
        c = _Carrier("rows", {"rows": "cat"}, {"rows": first})
        sync_observers([c])
        res["cat/1"] = c.rows.clone()
        c.rows = torch.cat([c.rows, torch.full((1, 2), 2.0 + rank)])
        sync_observers([c])
        res["cat/2"] = c.rows.clone()
        # NaN in rank 1's shard with GPTQ asked for: both ranks fail, each with one line
        bad = [x if i != 6 else x * float("nan") for i, x in enumerate(data)]
        try:
            _quantize(model, quantkit.shard(bad), "w8a8_gptq", "auto")
            res["nan"] = "no error"
        except Exception as exc:  # noqa: BLE001 (type and message are checked by the test)
            res["nan"] = f"{type(exc).__name__}: {exc}"
        # a GPTQ pass that fails on rank 1 only (after a calibration pass that passed everywhere)
        original = HessianObserver._observe

        def failing(self, x):
            raise quantkit.CalibrationError(f"observer at node '{self.node_name}' failed on purpose")

        if rank == 1:
            HessianObserver._observe = failing
        try:
            _quantize(model, mine, "int4_gptq", "auto")
            res["gptq_fails"] = "no error"
        except Exception as exc:  # noqa: BLE001
            res["gptq_fails"] = f"{type(exc).__name__}: {exc}"
        finally:
            HessianObserver._observe = original
        res["after"] = _rounded(_quantize(model, mine, "int4_gptq", "auto"))  # the group still works
        return res

    return run_ranks(work, tmp_path_factory.mktemp("rounding_ranks"))




def _assert_state_equal(ref: dict, got: dict, what: str) -> None:
    assert ref.keys() == got.keys(), what
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not bad, f"{what}: differs from one process at {bad}"


@pytest.mark.parametrize("alpha", [0.5, "auto"])
def test_smoothquant_factors_equal_one_process(ranks, alpha):
    model, data = _model_and_data()
    ref = quantkit.smooth_quant(model, data, alpha=alpha, distributed=False).state_dict()
    for rank in range(WORLD):
        _assert_state_equal(ref, ranks[rank][f"smooth/{alpha}"], f"smooth_quant alpha={alpha} rank {rank}")
    # the check can fail: rank 0's shard alone gives other factors
    local = ranks[0]["smooth/local"]
    assert any(not torch.equal(ref[k], local[k]) for k in ref)


def _assert_awq_ranks_equal(ranks, ref: dict, key: str) -> None:
    """Every rank's AWQ weights and qparams (``ranks[rank][key]``) ``torch.equal`` to one process's
    ``ref``, and the check can fail: AWQ on rank 0's shard alone (``key + "/local"``) differs."""
    for rank in range(WORLD):
        got = ranks[rank][key]
        assert got.keys() == ref.keys()
        for name in ref:
            assert all(torch.equal(a, b) for a, b in zip(ref[name], got[name])), (rank, name)
    local = ranks[0][f"{key}/local"]
    assert any(not torch.equal(ref[n][0], local[n][0]) for n in ref)


def test_awq_equals_one_process(ranks):
    model, data = _model_and_data()
    ref = _rounded(_quantize(model, data, "int4_awq", False))
    assert len(ref) == 4
    _assert_awq_ranks_equal(ranks, ref, "int4_awq")


def test_awq_block_loss_on_whole_batches_equals_one_process(ranks):
    """The attention block is scored on the batches with the smallest keys of all ranks'."""
    _, data = _model_and_data()
    prepared = _quantize(_attention_model(), data, "int4_awq", False)
    ref = _rounded(prepared)
    losses = [r["loss"] for r in prepared.meta[_rounding.ROUNDING_META_KEY]]
    assert losses.count("block") >= 2 and len(ref) == 4  # qkv (the attention) and fc1 (the MLP)
    assert all(ranks[rank]["int4_awq/attention/loss"] == losses for rank in range(WORLD))
    _assert_awq_ranks_equal(ranks, ref, "int4_awq/attention")


def _integers(weight, scale, zp) -> torch.Tensor:
    """The integers of a rounded weight under its observer's (per-channel or group-wise) qparams;
    checks that the weight lies on that grid."""
    scale, zp = scale.reshape(weight.shape[0], -1), zp.reshape(weight.shape[0], -1)
    gs = weight.shape[1] // scale.shape[1]
    s, z = scale.repeat_interleave(gs, 1).double(), zp.repeat_interleave(gs, 1).double()
    q = torch.round(weight.double() / s) + z
    assert torch.equal(((q - z) * s).float(), weight)
    return q


@pytest.mark.parametrize("scheme", ["w8a8_gptq", "int4_gptq"])
def test_gptq_ranks_identical_and_integers_equal_one_process(ranks, scheme):
    model, data = _model_and_data()
    prepared = _quantize(model, data, scheme, False)
    ref = _rounded(prepared)
    assert len(ref) == 4
    for name in ref:  # every rank rounds identically
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][scheme][name], ranks[1][scheme][name])), name
    same = total = 0
    for name, (w, scale, zp) in ref.items():
        got = ranks[0][scheme][name]
        q_ref, q_got = _integers(w, scale, zp), _integers(*got)
        same += int((q_ref == q_got).sum())
        total += q_ref.numel()
    assert same >= 0.999 * total, f"{scheme}: GPTQ integers equal one process's on {same}/{total}"
    # each block's Hessian counted every rank's rows: 8 batches x 16 x 32
    rows = [r["rows"] for r in prepared.meta[_rounding.ROUNDING_META_KEY]]
    assert rows == [8 * 16 * 32] * 4 and ranks[1][f"{scheme}/rows"].tolist() == rows


def test_hessian_sync_is_one_process_merging_the_ranks_observers_in_rank_order(ranks):
    batches = _hessian_batches()
    merged = _hessians(quantkit.shard(batches, 0, WORLD))
    merged.merge(_hessians(quantkit.shard(batches, 1, WORLD)))
    # independent reference: the float64 sums written out
    x0, x1 = (torch.cat([b.double() for b in quantkit.shard(batches, r, WORLD)]) for r in range(WORLD))
    torch.testing.assert_close(merged.xtx, x0.T @ x0 + x1.T @ x1, rtol=1e-12, atol=0)
    for rank in range(WORLD):
        xtx, rows = ranks[rank]["hessian"]
        assert torch.equal(xtx, merged.xtx) and int(rows) == 200, rank


def test_a_failing_rank_fails_gptq_on_every_rank(ranks):
    r0, r1 = ranks[0]["nan"], ranks[1]["nan"]
    assert r1.startswith("CalibrationError: observer at node") and "NaN or inf" in r1, r1
    assert r0 == "CalibrationError: calibration failed on rank 1 of 2 (see that rank's error); every rank stops", r0
    assert "\n" not in r0 + r1


def test_a_rank_failing_in_a_gptq_pass_fails_every_rank(ranks):
    r0, r1 = ranks[0]["gptq_fails"], ranks[1]["gptq_fails"]
    assert r1.startswith("CalibrationError: observer at node") and r1.endswith("failed on purpose"), r1
    assert r0 == "ValueError: observer sync failed on another rank (see its error)", r0
    for name, got in ranks[1]["after"].items():
        assert all(torch.equal(a, b) for a, b in zip(ranks[1]["int4_gptq"][name], got)), name


def test_cat_rows_in_rank_order_then_only_new_rows(ranks):
    once = torch.tensor([[0.0, -0.0], [1.0, 1.0], [1.0, -0.0]])
    twice = torch.cat([once, torch.tensor([[2.0, 2.0], [3.0, 3.0]])])
    for rank in range(WORLD):
        got1, got2 = ranks[rank]["cat/1"], ranks[rank]["cat/2"]
        assert torch.equal(got1, once) and torch.equal(got2, twice), rank
        assert torch.equal(torch.signbit(got2), torch.signbit(twice)), rank  # -0.0 survives (MAX, not SUM, padding)


def test_nccl_reduces_on_the_current_cuda_device(monkeypatch):
    """Only the device choice can be checked without a GPU: NCCL buffers go to the current CUDA
    device (``_allreduce`` copies them there and back), gloo's stay on the CPU."""
    from quantkit.observers import _sync

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _sync._comm_device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _sync._comm_device(None) == torch.device("cpu")


def _nibbles(model) -> dict:
    """The int4 codes (unpacked from their bytes) and the scales of a loaded weight-only artifact."""
    out = {}
    for name, t in model.named_buffers():
        if t.dtype == torch.uint8:
            out[name] = torch.stack([t & 15, t >> 4], -1).flatten()
        elif "_qk_scale" in name:
            out[name] = t
    return out


def test_torchrun_cli_gptq_equals_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m quantkit quantize --scheme w4a16 --algorithm gptq``: the int4
    codes equal one process's on >= 99.9 % (the documented Hessian equivalence)."""
    from quantkit.cli import main
    from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

    weights, calib = write_mlp_inputs(tmp_path, 64)  # 8 batches of 8 rows: 4 per rank
    extra = ("--scheme", "w4a16", "--group-size", "32", "--algorithm", "gptq", "--batch-size", "8")
    proc = _torchrun(*mlp_quantize_args(weights, calib, tmp_path / "two", *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(mlp_quantize_args(weights, calib, tmp_path / "one", *extra)) == 0
    one, two = _nibbles(quantkit.load(tmp_path / "one")), _nibbles(quantkit.load(tmp_path / "two"))
    assert one.keys() == two.keys() and len(one) == 6
    codes = [k for k in one if one[k].dtype == torch.uint8]
    same = sum(int((one[k] == two[k]).sum()) for k in codes)
    total = sum(one[k].numel() for k in codes)
    assert same >= 0.999 * total, f"int4 codes equal on {same}/{total}"
