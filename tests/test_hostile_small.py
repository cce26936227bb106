"""Adversarial cases of issue 26's smaller items: ``--kv-cache`` without attention, API wording in
CLI errors, zero-width layers, library noise under ``--quiet``, ``auto_map`` in a compressed-tensors
export, and a source ``quantization_config`` refused before anything loads.

Failures follow the contract of ``tests/_hostile.py`` (exit code, one stderr line, inputs unchanged,
nothing left beside ``--out``); cases that must succeed check the result against the float model.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit.cli import main
from tests._hostile import _copy_dir, _fails, _sentences_file, _tiny_bert, _tree
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

transformers = pytest.importorskip("transformers")

# a refusal that needs only config.json (measured well under 0.5 s in-process; generous for a loaded box)
FAST_S = 2.0


# --- factories (quantize tests.test_hostile_small:NAME) -------------------------------------

class _Attention(torch.nn.Module):
    """One self-attention block over [batch, 8, 64] (4 heads) through scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 3 * 64)
        self.attn = _SDPA()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, 4, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(self.attn(q, k, v).transpose(1, 2).reshape(b, s, 64))


class _SDPA(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def attention() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Attention()


class _ZeroWidth(torch.nn.Module):
    """64 -> 16 -> 8 with a zero-width Linear beside it: ``Linear(0, 4)`` on an empty slice, or
    ``Linear(16, 0)``; its (empty, or bias-only) output is summed into the result."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Initializing zero-element tensors is a no-op"
            self.z = torch.nn.Linear(k, n)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x)
        z = self.z(h[..., : self.z.in_features])
        return self.b(h) + z.sum(-1, keepdim=True)


def zero_in() -> torch.nn.Module:
    return _ZeroWidth(0, 4)


def zero_out() -> torch.nn.Module:
    return _ZeroWidth(16, 0)


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture
def mlp_files(tmp_path):
    return write_mlp_inputs(tmp_path, calib_rows=32)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    # BertModel (token embeddings): the export's check compares every token's hidden state, where a
    # 3-class head's logits on two held-out rows make a noisy cosine for a random-weight model
    return _tiny_bert(tmp_path_factory.mktemp("bert") / "bert", cls=transformers.BertModel)


@pytest.fixture
def bert_copy(bert_dir, tmp_path) -> Path:
    return _copy_dir(bert_dir, tmp_path)


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> Path:
    return _sentences_file(tmp_path_factory.mktemp("text"), 10)


def _ct_args(model: Path, calib: Path, out: Path, *extra) -> list[str]:
    return ["quantize", str(model), "--calib", str(calib), "--out", str(out), "--quiet", "--seq-len", "16",
            "--format", "compressed-tensors", *extra]


def _calib_dir(tmp_path: Path, shape: tuple[int, ...]) -> Path:
    d = tmp_path / "calib"
    d.mkdir()
    torch.save(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), d / "b.pt")
    return d


def _beside(out: Path) -> list[str]:
    """Names next to ``out`` that a run may have left (temporary or progress directories)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# --- 1. --kv-cache without attention -------------------------------------------------------------

@pytest.mark.parametrize("scheme,kv", [("fp8", "fp8_e4m3"), ("fp8-dynamic", "int8")])
def test_kv_cache_on_a_model_without_attention_is_refused(mlp_files, tmp_path, capsys, monkeypatch, scheme, kv):
    """An MLP has no keys or values: --kv-cache is refused before calibration, not reported as applied."""
    weights, calib = mlp_files
    out = tmp_path / "out"
    calibrated = []
    monkeypatch.setattr(quantkit, "calibrate", lambda *a, **k: calibrated.append(1))
    from quantkit.cli import _torchrun as _distributed

    monkeypatch.setattr(_distributed, "calibrate", lambda *a, **k: calibrated.append(1))
    line = _fails(mlp_quantize_args(weights, calib, out, "--scheme", scheme, "--kv-cache", kv), capsys, code=1,
                  inputs=[weights, calib], out=out)
    assert "no attention found" in line and "--kv-cache" in line, line
    assert not calibrated, "refused only after calibrating"


@pytest.mark.parametrize("flags,described", [
    (["--scheme", "fp8", "--kv-cache", "fp8_e4m3"], "KV cache fp8_e4m3"),
    (["--scheme", "fp8-dynamic", "--kv-cache", "int8", "--kv-granularity", "per-head"], "KV cache int8 per head"),
])
def test_kv_cache_on_attention_is_applied_and_skipping_it_is_refused(tmp_path, capsys, flags, described):
    """Positive control: the same flags on a model with scaled_dot_product_attention record a key and a
    value scale (and say so in report.md and inspect); with the attention module under --skip there is
    again nothing to quantize."""
    calib = _calib_dir(tmp_path, (12, 8, 64))
    base = ["quantize", "tests.test_hostile_small:attention", "--example-input", "2x8x64:float32",
            "--calib", str(calib), "--quiet", *flags]
    good = tmp_path / "good"
    assert main(base + ["--out", str(good)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    doc = json.loads((good / "quantization.json").read_text())
    roles = sorted(t.get("kv_cache") for t in doc["tensors"] if t.get("kv_cache"))
    assert roles == ["key", "value"], roles
    assert doc["recipe"]["kv_cache"] == flags[3] and described in (good / "report.md").read_text()

    out = tmp_path / "skipped"
    line = _fails(base + ["--out", str(out), "--skip", "attn"], capsys, code=1, inputs=[calib], out=out)
    assert "no attention found outside the --skip patterns" in line and "--kv-cache" in line, line


# --- 2. API wording in CLI errors ------------------------------------------------------------------

_API_WORDS = ("set_module_name", "overwrite=True", "group_size=", "skip_unsupported=", "quantkit.", "=True", "(...")


def test_group_size_error_names_the_flags_and_its_suggestion_works(mlp_files, tmp_path, capsys):
    """Groups of 96 are wider than the MLP's 64-wide input: the line says --group-size and
    --skip (never set_module_name or group_size=), and the group size it suggests quantizes."""
    weights, calib = mlp_files
    out = tmp_path / "out"
    line = _fails(mlp_quantize_args(weights, calib, out, "--scheme", "w4a16", "--group-size", "96"), capsys, code=1,
                  inputs=[weights, calib], out=out)
    assert not any(w in line for w in _API_WORDS), line
    assert "--group-size 96" in line and "--skip fc" in line, line
    # the MLP's linears take 64, 128 and 128 input features: the largest group size dividing all is 64
    assert "pass --group-size 64" in line, line
    assert main(mlp_quantize_args(weights, calib, out, "--scheme", "w4a16", "--group-size", "64")) == 0
    assert capsys.readouterr().err == ""


def test_group_size_error_of_the_api_lists_every_layer():
    """The API error keeps the API's words and carries every misfit layer (the CLI words it from them):
    those narrower than one group (a group size that does not divide leaves a remainder group)."""
    from quantkit.quantizers import GroupSizeError, WeightOnlyQuantizer
    from tests.models import MLP

    model, x = MLP(d_in=96, d_hidden=80, d_out=8).eval(), torch.randn(2, 96)
    with pytest.raises(GroupSizeError) as info:
        quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(group_size=128))
    names = [name for name, _ in info.value.layers]
    expected = [f"{n}.weight" for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and m.in_features < 128]
    assert names == expected and len(expected) >= 2, (names, expected)
    assert "set_module_name(" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("fmt", ["pt2", "compressed-tensors", "pt2,compressed-tensors"])
def test_existing_out_names_the_force_flag(bert_dir, sentences, tmp_path, capsys, fmt):
    """An existing --out is refused with the CLI's --force, not the API's overwrite=True."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _fails(_ct_args(bert_dir, sentences, out)[:-2] + ["--format", fmt], capsys, code=2,
                  inputs=[bert_dir, sentences, out])
    assert "--force" in line and not any(w in line for w in _API_WORDS), line
    assert _beside(out) == []


def test_unexpressible_layers_name_the_skip_unsupported_flag(bert_dir, sentences, tmp_path, capsys):
    """Dynamic per-tensor int8 activations have no compressed-tensors scheme: the refusal names
    --skip-unsupported, not the API's skip_unsupported=True, and nothing is written."""
    out = tmp_path / "out"
    line = _fails(_ct_args(bert_dir, sentences, out, "--scheme", "w8a8-dynamic", "--num-calib", "4"), capsys,
                  code=1, inputs=[bert_dir, sentences], out=out)
    assert "cannot express dynamic per-tensor activations" in line and "pass --skip-unsupported" in line, line
    assert not any(w in line for w in _API_WORDS), line


def test_int8_kv_cache_for_compressed_tensors_is_refused_up_front(bert_dir, sentences, tmp_path, capsys,
                                                                   monkeypatch):
    """quantkit's int8 KV cache ([-127, 127]) is not the format's ([-128, 127]): refused before the model
    loads, in the CLI's words (it used to fail after calibration with kv_cache='fp8_e4m3')."""
    from quantkit.cli import _inputs

    ran = []
    monkeypatch.setattr(_inputs, "load_model", lambda *a, **k: ran.append("load") or 1 / 0)
    out = tmp_path / "out"
    line = _fails(_ct_args(bert_dir, sentences, out, "--scheme", "fp8", "--kv-cache", "int8"), capsys, code=2,
                  inputs=[bert_dir, sentences], out=out)
    assert "--kv-cache int8" in line and "use --kv-cache fp8_e4m3" in line, line
    assert not any(w in line for w in _API_WORDS) and not ran, (line, ran)


# --- 3. zero-width layers -----------------------------------------------------------------------

@pytest.mark.parametrize("factory", ["zero_in", "zero_out"])
@pytest.mark.parametrize("scheme", [[], ["--scheme", "w8a8-dynamic"], ["--scheme", "fp8"],
                                    ["--scheme", "w4a16", "--group-size", "16"],
                                    # the default search may reach SmoothQuant (which recipe depends on timing)
                                    ["--recipe", "per-token-smoothquant"]])
def test_zero_width_layer_stays_float(tmp_path, capsys, factory, scheme):
    """A Linear with no weights has nothing to observe: it stays float and the rest is quantized
    (never "has seen no data"); the artifact computes the float model's output."""
    calib = _calib_dir(tmp_path, (24, 64))
    out = tmp_path / "out"
    before = _tree(calib)
    rc = main(["quantize", f"tests.test_hostile_small:{factory}", "--example-input", "8x64:float32",
               "--calib", str(calib), "--out", str(out), "--quiet", *scheme])
    captured = capsys.readouterr()
    assert rc == 0 and captured.err == "" and captured.out == "", captured.err
    assert _tree(calib) == before and _beside(out) == []
    nodes = [t["node"] for t in json.loads((out / "quantization.json").read_text())["tensors"]]
    assert not any(n.startswith("z_") or "-> z" in n for n in nodes), nodes  # nothing of z is quantized
    assert any(n.startswith("a_weight") for n in nodes) and any(n.startswith("b_weight") for n in nodes), nodes
    model = globals()[factory]().eval()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(x), quantkit.load(out)(x)
    cos = torch.nn.functional.cosine_similarity(ref.flatten().double(), got.flatten().double(), dim=0)
    assert cos > 0.99, float(cos)


def test_observer_of_empty_tensors_says_so():
    """An observer that only ever saw tensors with no elements says that, not "has seen no data"
    (and an observer that saw nothing at all still says it)."""
    from quantkit import ConvertError
    from quantkit.observers import MinMaxObserver

    empty = MinMaxObserver()
    empty(torch.empty(0, 4))
    with pytest.raises(ConvertError, match="no elements") as info:
        empty.calculate_qparams()
    assert "has seen no data" not in str(info.value)
    with pytest.raises(ConvertError, match="has seen no data"):
        MinMaxObserver().calculate_qparams()


def test_convert_names_a_zero_size_input_a_third_party_quantizer_annotated():
    """A quantizer that is not quantkit's (it annotates every linear input, empty or not) gets convert's
    reason: the input has no elements, not "has seen no data" after a calibration that did run."""
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

    from quantkit import ConvertError
    from quantkit.observers import MinMaxObserver

    class EveryLinearInput(Quantizer):
        def annotate(self, model):
            for n in model.graph.nodes:
                if n.target == torch.ops.aten.linear.default:
                    spec = QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255, is_dynamic=False,
                                            qscheme=torch.per_tensor_affine, observer_or_fake_quant_ctr=MinMaxObserver)
                    n.meta["quantization_annotation"] = QuantizationAnnotation(input_qspec_map={n.args[0]: spec},
                                                                               _annotated=True)
            return model

        def validate(self, model):
            pass

    x = torch.randn(8, 64)
    prepared = quantkit.prepare(quantkit.capture(zero_in().eval(), (x,)), EveryLinearInput())
    quantkit.calibrate(prepared, [(x,)], progress=False)
    with pytest.raises(ConvertError, match="no elements") as info:
        quantkit.convert(prepared)
    assert "has seen no data" not in str(info.value) and "\n" not in str(info.value)


# --- 4. --quiet keeps other libraries' output off both streams -------------------------------------

def test_compressed_tensors_quiet_prints_nothing(bert_dir, sentences, tmp_path, capfd, monkeypatch):
    """What transformers / torchao / compressed-tensors print, log or warn while the export is written
    and verified reaches neither stdout nor stderr (file descriptors included) under --quiet."""
    import logging
    import os

    from quantkit.export import _ct_checks

    real, calls = _ct_checks.compare, []

    def noisy(*args, **kwargs):  # stands in for the libraries' noise, inside the verification
        calls.append(1)
        print("torchao: noise on stdout")
        print("torchao: noise on stderr", file=__import__("sys").stderr)
        os.write(1, b"C library noise on fd 1\n")
        os.write(2, b"C library noise on fd 2\n")
        logging.getLogger("torchao.quantization").warning("torchao: a logged warning")
        warnings.warn("torchao: a Python warning", UserWarning)
        return real(*args, **kwargs)

    monkeypatch.setattr(_ct_checks, "compare", noisy)
    out = tmp_path / "ct"
    before = {str(p): _tree(p) for p in (bert_dir, sentences)}
    capfd.readouterr()
    rc = main(_ct_args(bert_dir, sentences, out, "--num-calib", "4"))
    captured = capfd.readouterr()
    assert {str(p): _tree(p) for p in (bert_dir, sentences)} == before
    assert rc == 0, captured.err
    assert calls, "the noise was never emitted: the test would pass without the guard"
    assert captured.out == "" and captured.err == "", (captured.out, captured.err)
    assert (out / "config.json").is_file() and _beside(out) == []


# --- 5. auto_map without its files --------------------------------------------------------------

_PAYLOAD = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import {base}\n"


def _plant_remote_code(model: Path, marker: Path) -> None:
    """config.json and tokenizer_config.json name custom classes in .py files that write ``marker``
    when imported (the classes are transformers' own, so they would load if they ran)."""
    (model / "configuration_evil.py").write_text(
        _PAYLOAD.format(marker=str(marker), base="BertConfig") + "class EvilConfig(BertConfig):\n    pass\n")
    (model / "modeling_evil.py").write_text(
        _PAYLOAD.format(marker=str(marker), base="BertModel")
        + "from .configuration_evil import EvilConfig\n"
        + "class EvilModel(BertModel):\n    config_class = EvilConfig\n")
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"}
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = json.loads((model / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))


def test_auto_map_is_left_out_and_the_export_loads_without_its_code(bert_copy, sentences, tmp_path, capsys,
                                                                    monkeypatch):
    """The export is verified with transformers' own class, so it carries no auto_map pointing at code it
    lacks (and never copies or runs that code); transformers loads it back, with or without
    trust_remote_code, as that class. Positive control: the source's auto_map does run the payload."""
    import transformers.dynamic_module_utils as dyn

    marker = tmp_path / "payload-ran"
    _plant_remote_code(bert_copy, marker)
    modules = tmp_path / "hf-modules"  # where transformers copies remote code it runs
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(modules))
    before = _tree(bert_copy)
    out = tmp_path / "ct"
    rc = main(_ct_args(bert_copy, sentences, out, "--num-calib", "4"))
    err = capsys.readouterr().err
    assert rc == 0 and err == "", err
    assert _tree(bert_copy) == before and not marker.exists() and _beside(out) == []
    assert not list(out.glob("*.py"))
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    notes = json.loads((out / "quantkit_export.json").read_text())["notes"]
    assert any("config.json" in n and "auto_map" in n for n in notes), notes
    for trust in (False, True):
        loaded, info = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=trust,
                                                              output_loading_info=True)
        assert type(loaded) is transformers.BertModel
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=trust)
    assert not marker.exists(), "loading the export ran the source's custom code"
    # positive control: the source directory's auto_map runs the payload when trusted
    transformers.AutoConfig.from_pretrained(str(bert_copy), trust_remote_code=True)
    assert marker.exists()


# --- 6. a source quantization_config, refused before anything loads -------------------------------

@pytest.mark.parametrize("fmt", ["compressed-tensors", "pt2,compressed-tensors"])
def test_quantized_source_is_refused_before_loading(bert_copy, sentences, tmp_path, capsys, monkeypatch, fmt):
    """A config.json with a quantization_config fails in one line in under FAST_S, before the model is
    loaded or calibrated (both patched to record that they ran)."""
    from quantkit.cli import _inputs, _torchrun as _distributed

    cfg = json.loads((bert_copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    (bert_copy / "config.json").write_text(json.dumps(cfg, indent=2))
    ran = []
    monkeypatch.setattr(_inputs, "load_model", lambda *a, **k: ran.append("load") or 1 / 0)
    monkeypatch.setattr(_distributed, "calibrate", lambda *a, **k: ran.append("calibrate") or 1 / 0)
    monkeypatch.setattr(quantkit, "calibrate", lambda *a, **k: ran.append("calibrate") or 1 / 0)
    out = tmp_path / "out"
    start = time.perf_counter()
    line = _fails(_ct_args(bert_copy, sentences, out)[:-2] + ["--format", fmt], capsys, code=1,
                  inputs=[bert_copy, sentences], out=out)
    elapsed = time.perf_counter() - start
    assert "quantization_config" in line and "config.json" in line, line
    assert not ran, ran
    assert elapsed < FAST_S, f"refused after {elapsed:.1f} s"
