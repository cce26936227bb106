"""The acceptance test of the stage seams (issue 27): a new scheme defined entirely in this file runs
through prepare, calibrate, convert, compile, save/load and the command line, touching no library file.

The toy scheme, "toy-int3": symmetric per-tensor 3-bit weights (codes -3..3, scale = amax / 3) for
every linear, float activations. It registers

- its config, ``ToyConfig`` (a ``SchemeConfig`` subclass) and the preset (``register_scheme``);
- its observer, ``ToyAbsMaxObserver`` (``qkind = "toy-int"``), behind its own quantizer;
- its convert emitter (``@register_emitter("toy-int")``): int8 codes and a float scale as buffers, read by
  ``codes.to(float32) * scale``;
- its lowering pass (``@register_lowering("toy_dequant", ...)``): that pair of ops becomes one call of the
  toy's own ``toy::dequant`` op.

Numerics are checked against the toy's own float64 rounding of the float weights (not its observer or
emitter): the codes exactly, the outputs to float32 precision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.observer import ObserverBase
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

import quantkit
from quantkit.cli import main
from quantkit.lowering import register_lowering, unregister_lowering
from quantkit.pipeline.emit import Emitter, register_emitter
from quantkit.quantizers import SchemeConfig, available_schemes, get_scheme, register_scheme, unregister_scheme
from tests.models import make_mlp

aten = torch.ops.aten
SCHEME = "toy-int3"
BUFFER = "_toy_codes"  # the emitter's buffers: _toy_codes0, _toy_scale0, ...


# --- the scheme ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToyConfig(SchemeConfig):
    """Symmetric per-tensor ``bits``-bit linear weights, float activations."""

    TYPE = "tests.test_toy_scheme.ToyConfig"
    VERSION = 1
    bits: int = 3
    ops: frozenset = frozenset({"linear"})

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (2, 3, 4):
            raise ValueError(f"toy bits must be 2, 3 or 4, got {self.bits!r}")
        object.__setattr__(self, "ops", frozenset(self.ops))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def quantizer(self) -> "ToyQuantizer":
        return ToyQuantizer(self)


class ToyAbsMaxObserver(ObserverBase):
    """Records the absolute maximum of what it sees; its kind is the toy's own."""

    qkind = "toy-int"

    def __init__(self, dtype=torch.int8, quant_min=-3, quant_max=3, **_ignored) -> None:
        super().__init__(dtype=dtype)
        self.quant_min, self.quant_max = quant_min, quant_max
        self.qscheme = torch.per_tensor_symmetric
        self.node_name = "<unattached>"
        self.register_buffer("amax", torch.tensor(float("nan")))

    @property
    def calibrated(self) -> bool:
        return bool(torch.isfinite(self.amax))

    def forward(self, x):
        a = x.detach().abs().amax().float()
        self.amax = a if not self.calibrated else torch.maximum(self.amax, a)
        return x

    def calculate_qparams(self):
        return (self.amax / self.quant_max).reshape(1), torch.zeros(1, dtype=torch.int32)


class ToyQuantizer(Quantizer):
    """Annotates the weight of every linear with a :class:`ToyAbsMaxObserver`; ``set_module_name``
    keeps modules float (what ``quantkit quantize --skip`` needs)."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config, self.skipped = config, set()

    def set_module_name(self, name: str, config) -> "ToyQuantizer":
        assert config is None
        self.skipped.add(name)
        return self

    def annotate(self, model: GraphModule) -> GraphModule:
        q = self.config.qmax
        spec = QuantizationSpec(dtype=torch.int8, quant_min=-q, quant_max=q, qscheme=torch.per_tensor_symmetric,
                                observer_or_fake_quant_ctr=ToyAbsMaxObserver, is_dynamic=False)
        for node in model.graph.nodes:
            if node.op != "call_function" or node.target is not aten.linear.default:
                continue
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            if stack and any(stack[-1][0] == s or stack[-1][0].startswith(s + ".") for s in self.skipped):
                continue
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map={node.args[1]: spec}, _annotated=True)
        return model

    def validate(self, model: GraphModule) -> None:
        pass


@register_emitter("toy-int")
class ToyEmitter(Emitter):
    """A weight's codes (int8) and scale as buffers, dequantized by ``codes.to(float32) * scale``."""

    def emit(self, ctx, node: Node, obs) -> None:
        weight = ctx.constant(node.args[0])
        scale, _ = obs.calculate_qparams()
        codes = torch.clamp(torch.round(weight / scale), obs.quant_min, obs.quant_max).to(torch.int8)
        with ctx.graph.inserting_before(node):
            codes_node = ctx.new_attr(BUFFER, codes)
            scale_node = ctx.new_attr("_toy_scale", scale.float())
            as_float = ctx.graph.call_function(aten._to_copy.default, (codes_node,), {"dtype": torch.float32})
            out = ctx.graph.call_function(aten.mul.Tensor, (as_float, scale_node))
        ctx.records.append({"node": obs.node_name, "kind": "weight", "dtype": "int8", "qscheme": "toy_int3",
                            "scale": scale.reshape(-1).tolist(), "zero_point": [0],
                            "quant_min": obs.quant_min, "quant_max": obs.quant_max})
        ctx.finish(node, obs, out)


@torch.library.custom_op("toy::dequant", mutates_args=())
def toy_dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale


@toy_dequant.register_fake
def _(codes, scale):
    return torch.empty_like(codes, dtype=torch.float32)


def lower_toy(gm: GraphModule, ctx) -> dict[str, int]:
    """``mul(_to_copy(codes, float32), scale)`` of the toy's buffers -> ``toy::dequant(codes, scale)``."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.mul.Tensor:
            continue
        src, scale = node.args
        if not (isinstance(src, Node) and src.target is aten._to_copy.default and src.args[0].op == "get_attr"
                and str(src.args[0].target).startswith(BUFFER)):
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.toy.dequant.default, (src.args[0], scale))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        if not src.users:
            gm.graph.erase_node(src)
        count += 1
    gm.recompile()
    return {"toy_dequant": count}


@pytest.fixture(autouse=True, scope="module")
def toy_scheme():
    """The preset, registered while this file's tests run (other files see only the built-in ones)."""
    register_scheme(SCHEME, ToyConfig(bits=3), description="toy: 3-bit symmetric per-tensor linear weights (a test)")
    yield
    unregister_scheme(SCHEME)


@pytest.fixture
def toy_lowering():
    register_lowering("toy_dequant", order=250, devices=("cpu",))(lower_toy)
    yield
    unregister_lowering("toy_dequant")


# --- the independent reference ------------------------------------------------------------------
def _reference_codes(w: torch.Tensor, bits: int = 3) -> tuple[torch.Tensor, float]:
    """float64 symmetric rounding: codes round(w / s) in [-q, q], s = amax / q (q = 2^(bits-1) - 1)."""
    q = 2 ** (bits - 1) - 1
    w64 = w.detach().double()
    s = w64.abs().max().item() / q
    return torch.clamp(torch.round(w64 / s), -q, q), s


def _reference_model(model: torch.nn.Module, bits: int = 3) -> torch.nn.Module:
    ref = type(model)().double()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for lin in ref.modules():
            if isinstance(lin, torch.nn.Linear):
                codes, s = _reference_codes(lin.weight, bits)
                lin.weight.copy_(codes * s)
    return ref


def _codes(gm) -> list[torch.Tensor]:
    return [t for n, t in sorted(gm.named_buffers()) if n.startswith(BUFFER)]


# --- the stages ---------------------------------------------------------------------------------
def test_the_toy_scheme_is_registered():
    assert available_schemes()[-1] == SCHEME
    config = get_scheme(SCHEME)
    assert SchemeConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="toy bits must be 2, 3 or 4"):
        SchemeConfig.from_dict({**config.to_dict(), "fields": {"bits": 8, "ops": ["linear"]}})


def test_prepare_calibrate_convert_compile_save_load(tmp_path, toy_lowering):
    torch.manual_seed(0)
    model, x = make_mlp()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), get_scheme(SCHEME).quantizer())
    observers = [m for m in prepared.modules() if isinstance(m, ToyAbsMaxObserver)]
    assert len(observers) == 3
    quantkit.calibrate(prepared, [(b,) for b in x.split(32)], progress=False)
    converted = quantkit.convert(prepared)
    assert not any(isinstance(m, ToyAbsMaxObserver) for m in converted.modules())
    assert [r["qscheme"] for r in converted.meta["quantkit_qparams"]] == ["toy_int3"] * 3

    # numerics against the independent float64 rounding: the codes exactly, the outputs to float32 precision
    linears = [model.fc1, model.fc2, model.fc3]
    for codes, lin in zip(_codes(converted), linears):
        assert codes.dtype == torch.int8 and torch.equal(codes.double(), _reference_codes(lin.weight)[0])
    ref = _reference_model(model)
    with torch.no_grad():
        expected = ref(x.double()).float()
        torch.testing.assert_close(converted(x), expected, rtol=1e-5, atol=1e-5)

    # compile: the toy's pass ran at its order and rewrote all three dequantizations
    compiled = quantkit.compile(converted)
    gm = compiled._orig_mod
    assert gm.meta["quantkit_lowering"]["toy_dequant"] == 3
    assert sum(n.target is torch.ops.toy.dequant.default for n in gm.graph.nodes) == 3
    with torch.no_grad():
        torch.testing.assert_close(gm(x), expected, rtol=1e-5, atol=1e-5)  # the lowered graph, eagerly
        torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-4)  # through Inductor

    # save / load: the program and the config come back
    quantkit.save(converted, tmp_path / "toy")
    loaded = quantkit.load(tmp_path / "toy")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), converted(x), rtol=0, atol=0)


def test_quantize_with_the_scheme_name_records_its_config(tmp_path):
    torch.manual_seed(0)
    model, x = make_mlp()
    qmodel = quantkit.quantize(model, (x[:8],), [(b,) for b in x.split(32)], scheme=SCHEME, progress=False)
    assert qmodel.meta["quantkit_config"] == ToyConfig(bits=3)
    quantkit.save(qmodel, tmp_path / "toy")
    doc = json.loads((tmp_path / "toy" / "quantization.json").read_text())
    assert doc["config"] == {"type": "tests.test_toy_scheme.ToyConfig", "version": 1,
                             "fields": {"bits": 3, "ops": ["linear"]}}
    loaded = quantkit.load(tmp_path / "toy")
    assert loaded.meta["quantkit_config"] == ToyConfig(bits=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), _reference_model(model)(x.double()).float(), rtol=1e-5, atol=1e-5)


def test_the_command_line_runs_the_registered_scheme(tmp_path, capsys):
    from tests.cli_factories import mlp, mlp_quantize_args, write_mlp_inputs

    weights, calib = write_mlp_inputs(tmp_path, 48)
    model = mlp()
    model.load_state_dict(load_file(str(weights)))
    out = tmp_path / "toy-int3"
    args = mlp_quantize_args(weights, calib, out)
    assert main(args + ["--scheme", SCHEME, "--skip", "fc3"]) == 0, capsys.readouterr().err
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["recipe"]["scheme"] == SCHEME and doc["recipe"]["skip"] == ["fc3"]
    assert doc["config"] == ToyConfig(bits=3).to_dict()
    assert [r["qscheme"] for r in doc["tensors"]] == ["toy_int3"] * 2  # fc3 stayed float
    report = (out / "report.md").read_text()
    assert f"scheme `{SCHEME}` (tests.test_toy_scheme.ToyConfig): toy: 3-bit" in report

    loaded = quantkit.load(out)
    assert loaded.meta["quantkit_config"] == ToyConfig(bits=3)
    ref = _reference_model(model)
    with torch.no_grad():  # fc3 float in the artifact: the reference keeps it float too
        ref.fc3.weight.copy_(model.fc3.weight.double())
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(loaded(x), ref(x.double()).float(), rtol=1e-5, atol=1e-5)

    # the recipe flags of the built-in schemes are refused in one line
    assert main(args + ["--force", "--scheme", SCHEME, "--group-size", "32"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"quantkit: error: --group-size has no effect with --scheme {SCHEME} (a registered "
        "tests.test_toy_scheme.ToyConfig scheme: its config decides); drop it"]
