"""quantkit.save / quantkit.load: round trips, atomic writes, errors."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import quantkit
from tests.models import make_cnn, make_mlp, make_transformer


def _quantized(make):
    model, x = make()
    qmodel = quantkit.quantize(model, (x[:8],), [(b,) for b in x.split(32)], progress=False)
    return qmodel, x


@pytest.mark.parametrize("make", [make_mlp, make_cnn, make_transformer], ids=["mlp", "cnn", "transformer"])
def test_round_trip_gives_the_same_outputs(make, tmp_path):
    qmodel, x = _quantized(make)
    path = quantkit.save(qmodel, tmp_path / "int8")
    loaded = quantkit.load(path)
    with torch.no_grad():
        for batch in (x[:8], x[:3], x):  # other batch sizes than the captured one
            torch.testing.assert_close(loaded(batch), qmodel(batch), rtol=0, atol=0)


def test_saved_files(tmp_path):
    qmodel, _ = _quantized(make_mlp)
    path = quantkit.save(qmodel, tmp_path / "mlp")
    assert sorted(p.name for p in path.iterdir()) == ["model.pt2", "quantization.json"]
    doc = json.loads((path / "quantization.json").read_text())
    assert doc["format"] == "quantkit-int8" and doc["format_version"] == 1
    assert doc["model_sha256"] == hashlib.sha256((path / "model.pt2").read_bytes()).hexdigest()
    weights = [t for t in doc["tensors"] if t["kind"] == "weight"]
    assert len(weights) == 3 and all(len(t["scale"]) == t_out for t, t_out in zip(weights, (128, 128, 32)))
    # scales are written with float32 precision
    rec = qmodel.meta["quantkit_qparams"][0]
    saved = next(t for t in doc["tensors"] if t["node"] == rec["node"])
    assert torch.equal(torch.tensor(saved["scale"], dtype=torch.float32), torch.tensor(rec["scale"], dtype=torch.float32))
    # int8 weights only: no float copy of a quantized weight in the program
    ep = torch.export.load(str(path / "model.pt2"))
    dtypes = {tuple(t.shape): t.dtype for t in ep.state_dict.values() if t.dim() == 2}
    assert dtypes == {(128, 64): torch.int8, (128, 128): torch.int8, (32, 128): torch.int8}


def test_save_refuses_existing_dir_unless_overwrite(tmp_path):
    qmodel, x = _quantized(make_mlp)
    path = quantkit.save(qmodel, tmp_path / "m")
    with pytest.raises(quantkit.QuantkitError, match="already exists; pass overwrite=True"):
        quantkit.save(qmodel, path)
    quantkit.save(qmodel, path, overwrite=True)
    assert quantkit.load(path)(x[:2]).shape == (2, 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary dirs left


def test_save_rejects_unconverted_models(tmp_path):
    model, x = make_mlp()
    with pytest.raises(quantkit.QuantkitError, match="save expects the model returned by quantkit.convert"):
        quantkit.save(model, tmp_path / "m")
    with pytest.raises(quantkit.QuantkitError, match="save expects"):
        quantkit.save(quantkit.capture(model, (x[:8],)), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_load_errors(tmp_path):
    with pytest.raises(quantkit.QuantkitError, match="is not a directory"):
        quantkit.load(tmp_path / "missing")
    with pytest.raises(quantkit.QuantkitError, match="has no model.pt2"):
        quantkit.load(tmp_path)
    (tmp_path / "model.pt2").write_bytes(b"not a zip")
    with pytest.raises(quantkit.QuantkitError, match="cannot be verified: there is no quantization.json"):
        quantkit.load(tmp_path)
    with pytest.raises(quantkit.QuantkitError, match="could not load"):
        quantkit.load(tmp_path, allow_unverified=True)


def test_a_graph_without_capture_record_or_program_cannot_be_saved(tmp_path):
    qmodel, _ = _quantized(make_mlp)
    path = quantkit.save(qmodel, tmp_path / "a")
    gm = torch.export.load(str(path / "model.pt2")).module()  # not through quantkit.load: no program kept
    gm.meta["quantkit_converted"] = True
    with pytest.raises(quantkit.QuantkitError, match="no capture record"):
        quantkit.save(gm, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_the_same_model_saves_to_the_same_bytes_whatever_ran_before(tmp_path):
    """Saved programs carry no stack traces: they name the process's count of compiled graph
    modules (<eval_with_key>.N) and absolute source paths, which made two quantizations of one
    model differ in bytes (issue 28, a reproducible choice)."""
    model, x = make_mlp()
    q = quantkit.quantize(model, (x[:8],), [x[:16]], progress=False)
    quantkit.save(q, tmp_path / "a")
    for _ in range(3):  # other graph modules compiled in between move the <eval_with_key> counter
        torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    quantkit.save(q, tmp_path / "b")
    a, b = ((tmp_path / d / "model.pt2").read_bytes() for d in "ab")
    assert a == b
    assert b"eval_with_key" not in a and b"test_artifact.py" not in a  # no trace of this process in the file
    with torch.no_grad():
        assert torch.equal(quantkit.load(tmp_path / "b")(x), q(x))
