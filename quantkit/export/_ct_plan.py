"""Read a converted quantkit graph as compressed-tensors layers.

Which HF modules hold quantized weights (int8, FP8, group-wise int4/int8: ``_ct_schemes``), how their inputs are quantized, which quantized
tensors the format stores dequantized (weight-only embeddings), and what it cannot
express. Pure graph reading: nothing here imports compressed-tensors or writes files.

The mapping is general, not per architecture: a quantized ``aten.linear`` names its
module through torch.export's ``nn_module_stack`` (the HF parameter is ``<module>.weight``),
its int8 weight is the ``_frozen_param<i>`` buffer its weight ``dequantize`` reads, and its
input quantization is the ``quantize``/``dequantize`` pair feeding it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from .._graph import DEQUANTIZE_OPS, FLOAT8_DEQUANTIZE_OPS, FLOAT8_QUANTIZE_OPS, QUANTIZE_OPS, get_attr, module_scopes
from .._qmath import FLOAT8_DTYPES
from . import _ct_schemes as schemes

__all__ = ["ActQuant", "WeightQuant", "LinearLayer", "Unsupported", "Plan", "read_graph", "PASSTHROUGH",
           "ANY_QUANTIZE", "ANY_DEQUANTIZE", "recorded_modules"]

aten = torch.ops.aten
_QD = torch.ops.quantized_decomposed

# ops that move or select elements without changing them: elementwise quantization commutes
# with them exactly, so dequantize -> op -> quantize with the same qparams stores the same integers
PASSTHROUGH = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.flatten.using_ints, aten.squeeze.dim, aten.unsqueeze.default,
    aten.slice.Tensor, aten.select.int, aten.expand.default, aten.contiguous.default, aten.clone.default,
})
_CHOOSE = frozenset({_QD.choose_qparams.tensor, _QD.choose_qparams_symmetric.tensor,
                     _QD.choose_qparams_per_token.default, torch.ops.torchao.choose_scale_float8.default})
ANY_QUANTIZE = QUANTIZE_OPS | FLOAT8_QUANTIZE_OPS
ANY_DEQUANTIZE = DEQUANTIZE_OPS | FLOAT8_DEQUANTIZE_OPS
_SDPA = aten.scaled_dot_product_attention.default
_STATIC_DQ = frozenset({_QD.dequantize_per_tensor.default})
_DYNAMIC_DQ = frozenset({_QD.dequantize_per_tensor.tensor})
_TOKEN_DQ = frozenset({_QD.dequantize_per_token.default})
_ACT_DQ = _STATIC_DQ | _DYNAMIC_DQ | _TOKEN_DQ
_CONV = frozenset({aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                   aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding})
_MATMUL = frozenset({aten.matmul.default, aten.bmm.default, aten.mm.default})

# what to do instead, per reason a layer cannot be stored (the CLI flags; the Python API has the same fields)
HINT_8BIT = "compressed-tensors' int8 scheme (and vLLM) takes full-range 8-bit activations: quantize with " \
            "--activation affine-uint8 or symmetric-int8"
HINT_TOKEN = "vLLM runs dynamic int8 activations per token only: quantize with --scheme w8a8-per-token"
HINT_LINEAR = "the format stores quantized nn.Linear layers only: quantize with --ops linear"
HINT_LATER = schemes.HINT_SCHEMES


@dataclass(frozen=True)
class ActQuant:
    """How a linear's input is quantized: ``"static"`` per tensor (scale, zero point),
    ``"dynamic-token"`` or ``"dynamic-tensor"`` (chosen at run time)."""

    kind: str
    dtype: torch.dtype
    quant_min: int
    quant_max: int
    scale: float | None = None
    zero_point: int | None = None

    def problem(self) -> tuple[str, str] | None:
        """``(what, hint)`` when compressed-tensors' int-quantized scheme cannot express it exactly."""
        full = {torch.uint8: (0, 255), torch.int8: (-128, 127)}.get(self.dtype)
        if self.dtype in FLOAT8_DTYPES:
            return f"{str(self.dtype).replace('torch.', '')} activations", HINT_LATER
        if full is None or (self.quant_min, self.quant_max) != full:
            return (f"{str(self.dtype).replace('torch.', '')} activations in [{self.quant_min}, {self.quant_max}]",
                    HINT_8BIT)
        if self.kind == "dynamic-tensor":
            return "dynamic per-tensor activations", HINT_TOKEN
        if self.kind == "dynamic-token" and self.dtype != torch.int8:
            return "asymmetric per-token activations", HINT_TOKEN
        return None

    @property
    def symmetric(self) -> bool:
        # uint8 [0, 255] becomes int8 [-128, 127] with its zero point shifted by -128: asymmetric
        return self.kind != "static" or (self.dtype == torch.int8 and self.zero_point == 0)

    def int8_zero_point(self) -> int:
        """The zero point on compressed-tensors' int8 grid [-128, 127] (uint8's shifted by -128)."""
        assert self.kind == "static" and self.zero_point is not None
        return self.zero_point - 128 if self.dtype == torch.uint8 else self.zero_point

    def signature(self) -> tuple:
        return (self.kind, self.symmetric)

    def args(self) -> dict:
        return schemes.quant_args(num_bits=8, type="int", symmetric=self.symmetric,
                                  strategy="tensor" if self.kind == "static" else "token", dynamic=self.kind != "static")

    def stored(self) -> dict[str, torch.Tensor]:
        if self.kind != "static":
            return {}
        out = {"input_scale": torch.tensor([self.scale], dtype=torch.float32)}
        if not self.symmetric:
            out["input_zero_point"] = torch.tensor([self.int8_zero_point()], dtype=torch.int8)
        return out

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """quantkit's quantization of ``x``, with torch's quantized_decomposed ops."""
        args = (self.quant_min, self.quant_max, self.dtype)
        if self.kind == "static":
            q = _QD.quantize_per_tensor.default(x, self.scale, self.zero_point, *args)
            return _QD.dequantize_per_tensor.default(q, self.scale, self.zero_point, *args)
        scale, zp = _QD.choose_qparams_per_token.default(x, self.dtype)
        q = _QD.quantize_per_token.default(x, scale, zp, *args)
        return _QD.dequantize_per_token.default(q, scale, zp, *args, x.dtype)

    def same(self, other) -> bool:
        return self == other


@dataclass(frozen=True)
class WeightQuant:
    """An integer weight as convert folded it: ``q`` [out, in], per-channel (``axis``) or per-tensor scales."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int | None
    quant_min: int
    quant_max: int

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight quantkit's model computes with: ``(q - zp) * scale``, as torch's dequantize does."""
        if self.axis is None:
            return _QD.dequantize_per_tensor.default(self.q, float(self.scale.reshape(-1)[0]),
                                                     int(self.zero_point.reshape(-1)[0]), self.quant_min,
                                                     self.quant_max, self.q.dtype).to(dtype)
        return _QD.dequantize_per_channel.default(self.q, self.scale, self.zero_point, self.axis, self.quant_min,
                                                  self.quant_max, self.q.dtype).to(dtype)

    def problem(self) -> tuple[str, str] | None:
        if self.q.dtype in FLOAT8_DTYPES:
            return f"{str(self.q.dtype).replace('torch.', '')} weights", HINT_LATER
        if self.q.dtype != torch.int8 or self.quant_min < -128 or self.quant_max > 127:
            return f"{str(self.q.dtype).replace('torch.', '')} weights in [{self.quant_min}, {self.quant_max}]", \
                HINT_LATER
        if bool((self.zero_point != 0).any()):
            return "asymmetric int8 weights", "vLLM's int8 kernels take symmetric weights: use a symmetric " \
                                              "weight observer (the default per_channel_minmax)"
        if self.axis not in (None, 0) or self.q.dim() != 2:
            return f"int8 weights quantized along axis {self.axis}", HINT_LINEAR
        return None

    @property
    def strategy(self) -> str:
        return "tensor" if self.axis is None else "channel"

    def scale_2d(self) -> torch.Tensor:
        """compressed-tensors' layout: ``[out, 1]`` per channel, ``[1]`` per tensor, float32."""
        s = self.scale.detach().to(torch.float32)
        return s.reshape(1) if self.axis is None else s.reshape(-1, 1)

    format = schemes.FORMAT_INT

    def args(self) -> dict:
        return schemes.quant_args(num_bits=8, type="int", symmetric=True, strategy=self.strategy)

    def stored(self) -> dict[str, torch.Tensor]:
        return {"weight": self.q.contiguous(), "weight_scale": self.scale_2d().contiguous()}


@dataclass
class LinearLayer:
    """An nn.Linear stored quantized with its input quantization (None: weight-only)."""

    module: str
    weight: object  # WeightQuant, schemes.Float8Weight or schemes.GroupWeight
    act: object  # ActQuant, schemes.Float8Act or None


@dataclass(frozen=True)
class Unsupported:
    """A quantized layer the format cannot express: where, what, and what to do instead."""

    module: str
    what: str
    hint: str


@dataclass
class Plan:
    """What the export writes: int8 linears, weights written dequantized, and what is left out."""

    linears: dict[str, LinearLayer] = field(default_factory=dict)
    # HF parameter name -> the dequantized float weight (weight-only embeddings; skipped layers)
    dequantized: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_only: list[str] = field(default_factory=list)  # modules whose weight-only int8 is written dequantized
    unsupported: list[Unsupported] = field(default_factory=list)
    # activation dequantize nodes whose quantization the format drops (kept float with skip_unsupported)
    bypass: list[str] = field(default_factory=list)
    # attention module -> its static K/V quantization (kv_cache_scheme)
    kv: dict[str, schemes.KVCache] = field(default_factory=dict)


def _int8_weight(gm: GraphModule, dq: Node) -> WeightQuant:
    q = get_attr(gm, dq.args[0].target)
    if dq.target == _QD.dequantize_per_channel.default:
        scale, zp = (get_attr(gm, a.target) if isinstance(a, Node) else a for a in dq.args[1:3])
        axis, qmin, qmax = dq.args[3], dq.args[4], dq.args[5]
        return WeightQuant(q, torch.as_tensor(scale), torch.as_tensor(zp), int(axis), int(qmin), int(qmax))
    scale, zp, qmin, qmax = (get_attr(gm, a.target) if isinstance(a, Node) else a for a in dq.args[1:5])
    return WeightQuant(q, torch.as_tensor(scale, dtype=torch.float32).reshape(1),
                       torch.as_tensor(zp).reshape(1), None, int(qmin), int(qmax))


def _int8_act(dq: Node) -> ActQuant:
    if dq.target in _STATIC_DQ:
        scale, zp, qmin, qmax, dtype = dq.args[1:6]
        return ActQuant("static", dtype, int(qmin), int(qmax), float(scale), int(zp))
    if dq.target in _TOKEN_DQ:
        qmin, qmax, dtype = dq.args[3:6]
        return ActQuant("dynamic-token", dtype, int(qmin), int(qmax))
    if dq.target in _DYNAMIC_DQ:
        qmin, qmax, dtype = dq.args[3:6]
        return ActQuant("dynamic-tensor", dtype, int(qmin), int(qmax))
    raise AssertionError(f"unhandled activation dequantize {dq.target}")  # _ACT_DQ are all above


@schemes.register_reader(*DEQUANTIZE_OPS)
def _read_int8(gm: GraphModule, dq: Node) -> tuple[str, object]:
    """W8A8 int8: a folded weight, a quantized activation, or what the format cannot store."""
    src = dq.args[0]
    if isinstance(src, Node) and src.op == "get_attr":
        return schemes.WEIGHT, _int8_weight(gm, dq)
    if isinstance(src, Node) and src.target in QUANTIZE_OPS and dq.target in _ACT_DQ:
        return schemes.ACT, _int8_act(dq)
    if isinstance(src, Node) and src.target in QUANTIZE_OPS:
        return schemes.UNKNOWN, "per-channel activation quantization"
    return schemes.UNKNOWN, "a dequantize of a computed value"


def _module(node: Node) -> str:
    scopes = module_scopes(node)
    return scopes[-1][0] if scopes else ""


def _what(user: Node, role: str) -> str:
    """How an unsupported quantized consumer is named in messages."""
    if user.target in _CONV:
        return "a quantized convolution"
    if user.target == aten.addmm.default:
        return "GPT-2's Conv1D (addmm), which is not an nn.Linear"
    if user.target in _MATMUL:
        return "a quantized matmul between activations" if role == "input" else "a quantized matmul"
    op = getattr(user.target, "__name__", str(user.target))
    return f"a quantized input of {op}" if role == "input" else f"{op} with an int8 constant"


class _Reader:
    def __init__(self, gm: GraphModule, hf_modules: dict[str, torch.nn.Module], cached_attention):
        self.gm = gm
        self.cached_attention = cached_attention
        self.recorded = recorded_modules(gm, hf_modules)
        self.hf = hf_modules
        self.plan = Plan()
        self.weight_dq: dict[Node, WeightQuant] = {}
        self.act_dq: dict[Node, ActQuant] = {}
        self.unknown_dq: dict[Node, str] = {}

    def _mod(self, node: Node) -> str:
        """The HF module ``node`` runs in: its ``nn_module_stack``, else (a graph loaded with
        ``quantkit.load``) the module whose weight ``quantization.json`` records for it."""
        return _module(node) or self.recorded.get(node.name, "")

    # --- what each dequantize holds -------------------------------------------------------
    def classify(self) -> None:
        """Sort every dequantize by what its registered reader says it holds (``_ct_schemes.register_reader``)."""
        by_role = {schemes.WEIGHT: self.weight_dq, schemes.ACT: self.act_dq, schemes.UNKNOWN: self.unknown_dq}
        for node in self.gm.graph.nodes:
            if node.op != "call_function":
                continue
            read = schemes.reader_for(node.target)
            if read is not None:
                role, value = read(self.gm, node)
                by_role[role][node] = value
            elif "dequantize" in str(node.target) or "dequant" in getattr(node.target, "__name__", ""):
                # quantization representations the export does not read yet (group-wise, int4, ...)
                name = str(node.target)
                self.unknown_dq[node] = ("FP8 (float8) quantization" if "float8" in name else
                                         f"quantization by {name.split('.')[-2] if '.' in name else name}")

    # --- consumers ------------------------------------------------------------------------
    def _hf_weight(self, module: str, shape) -> str | None:
        """``<module>.weight`` when the HF model has that parameter with this shape."""
        mod = self.hf.get(module)
        w = getattr(mod, "weight", None) if mod is not None else None
        return f"{module}.weight" if isinstance(w, torch.Tensor) and tuple(w.shape) == tuple(shape) else None

    def _unsupported(self, module: str, what: str, hint: str) -> None:
        if not any(u.module == module and u.what == what for u in self.plan.unsupported):
            self.plan.unsupported.append(Unsupported(module, what, hint))

    def _dequantize_weight(self, module: str, w: WeightQuant) -> bool:
        name = self._hf_weight(module, w.q.shape)
        if name is None:
            return False
        self.plan.dequantized[name] = w.dequantized()
        return True

    def read(self) -> Plan:
        self.classify()
        linear_inputs: set[Node] = set()
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target == aten.linear.default:
                if self._linear(node):
                    linear_inputs.add(node.args[0])
        self._weights_elsewhere()
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target == _SDPA:
                self._kv(node)
        self._activation_uses(linear_inputs)
        for name, w in schemes.group_weights_strategy({n: lin.weight for n, lin in self.plan.linears.items()}).items():
            self.plan.linears[name].weight = w
        for node, what in self.unknown_dq.items():
            what, hint = what if isinstance(what, tuple) else (what, HINT_LATER)
            for user in node.users:
                module = self._mod(user)
                self._unsupported(module or node.name, what, hint)
                w = self._nf4_float(node)
                name = self._hf_weight(module, w.shape) if w is not None else None
                if name is not None and user.target == aten.linear.default:
                    self.plan.dequantized.setdefault(name, w)
        return self.plan

    def _linear(self, node: Node) -> bool:
        """Record one aten.linear; True when it is stored int8 with its input quantization."""
        module = self._mod(node)
        x, w = node.args[0], node.args[1]
        wq, aq = self.weight_dq.get(w), self.act_dq.get(x)
        if wq is None and aq is None:
            return False  # a float linear
        mod = self.hf.get(module)
        if not isinstance(mod, torch.nn.Linear) or (wq is not None and self._hf_weight(module, wq.q.shape) is None):
            owner = type(mod).__name__ if mod is not None else "no module of the HF model"
            self._unsupported(module or node.name, f"a quantized linear call in {owner}", HINT_LINEAR)
            if wq is not None:
                self._dequantize_weight(module, wq)
            return False
        problem = None
        if wq is None:
            problem = ("a quantized input without quantized weights", HINT_LATER)
        elif aq is None and not isinstance(wq, schemes.GroupWeight):
            problem = ("per-channel weight-only int8", "quantize weight-only layers with --scheme w8a16 "
                       "(WeightOnlyQuantizer(bits=8))")
        else:
            problem = schemes.pair_problem(wq, aq) or wq.problem() or (aq.problem() if aq is not None else None)
        if problem is None and module in self.plan.linears:
            prev = self.plan.linears[module]
            if not (aq.same(prev.act) if aq is not None else prev.act is None) or \
                    not torch.equal(prev.weight.q.view(torch.uint8), wq.q.view(torch.uint8)):
                problem = ("one module called with different input quantization", HINT_LINEAR)
        if problem is not None:
            self._unsupported(module, *problem)
            self.plan.linears.pop(module, None)
            if wq is not None:
                self._dequantize_weight(module, wq)
            return False
        if not any(u.module == module for u in self.plan.unsupported):
            self.plan.linears[module] = LinearLayer(module, wq, aq)
            return True
        return False

    def _weights_elsewhere(self) -> None:
        """Integer weights read by anything but a linear: weight-only embeddings are written
        dequantized (their values are exactly what quantkit's model computes with); the rest
        (conv, GPT-2's addmm, matmul with a constant) cannot be stored."""
        for dq, wq in self.weight_dq.items():
            for user in dq.users:
                if user.target == aten.linear.default and user.args[1] is dq:
                    continue
                module = self._mod(user)
                if user.target == aten.embedding.default and user.args[0] is dq and \
                        isinstance(self.hf.get(module), torch.nn.Embedding):
                    if self._dequantize_weight(module, wq):
                        if module not in self.plan.weight_only:
                            self.plan.weight_only.append(module)
                        continue
                what = _what(user, "weight")
                self._unsupported(module or user.name, what, HINT_LINEAR)
                self._dequantize_weight(module, wq)

    def _activation_uses(self, linear_inputs: set[Node]) -> None:
        """Every use of a quantized activation must be a stored linear's input, or pass the
        integers unchanged to a requantization with the same qparams; anything else is a
        quantization the format cannot express (its dequantize is bypassed when skipping)."""
        for dq, aq in self.act_dq.items():
            for user in list(dq.users):
                if dq in linear_inputs and user.target == aten.linear.default and user.args[0] is dq:
                    module = self._mod(user)
                    if module in self.plan.linears:
                        continue
                if user.target == _SDPA and dq in user.args[1:3] and self._mod(user) in self.plan.kv:
                    continue  # a K/V input: the kv_cache_scheme's scales
                if user.target in _CHOOSE or (user.target == aten.abs.default and user.users and all(
                        u.target == aten.amax.default for u in user.users)):  # amax(abs(x)): a dynamic FP8 scale
                    continue  # a dynamic requantization: its quantize reads this dequantize too
                if user.target in PASSTHROUGH and user.users and all(
                        self._same_requant(dq, q) for q in user.users):
                    continue
                listed = user.target == _SDPA and any(u.module == self._mod(user) for u in self.plan.unsupported)
                if not listed and not (user.target == aten.linear.default and user.args[0] is dq):  # else: listed
                    self._unsupported(self._mod(user) or user.name, _what(user, "input"), HINT_LINEAR)
                if dq.name not in self.plan.bypass:
                    self.plan.bypass.append(dq.name)

    def _same_requant(self, dq: Node, q: Node) -> bool:
        """``q`` quantizes with exactly ``dq``'s static qparams, and every use of it is stored."""
        act = self.act_dq.get(dq)
        if act is None or act.kind != "static" or not all(d in self.act_dq for d in q.users):
            return False
        if q.target == _QD.quantize_per_tensor.default and dq.target in _STATIC_DQ:
            return tuple(q.args[1:6]) == tuple(dq.args[1:6])
        if q.target in FLOAT8_QUANTIZE_OPS:
            return all(act.same(self.act_dq[d]) for d in q.users)
        return False

    def _kv(self, sdpa: Node) -> None:
        """An attention whose key and value inputs are statically quantized: its KV-cache scales,
        when ``cached_attention`` says the format scales that module's cache, else an unsupported layer."""
        k, v = (self.act_dq.get(a) for a in sdpa.args[1:3])
        if k is None and v is None:
            return
        module = self._mod(sdpa)
        if k is None or v is None:
            self._unsupported(module or sdpa.name, "a quantized key or value without the other",
                              "quantize both (FP8Quantizer(kv_cache=...))")
            return
        kv = schemes.KVCache(module, k, v, (sdpa.args[1].name, sdpa.args[2].name))
        problem = kv.problem()
        if problem is None and type(k) is not type(v):
            problem = ("keys and values in different formats", "quantize both with one kv_cache format")
        if problem is None and self.plan.kv and json.dumps(next(iter(self.plan.kv.values())).args()) != \
                json.dumps(kv.args()):
            problem = ("two KV-cache formats in one model", "the format takes one kv_cache_scheme")
        if problem is None and not self.cached_attention(self.hf.get(module)):
            owner = type(self.hf.get(module)).__name__ if module in self.hf else "no module of the HF model"
            problem = (f"a KV cache in {owner}", "the format's KV-cache scales belong to attention modules with "
                       "k_proj/v_proj (decoders such as Llama): quantize without kv_cache")
        if problem is not None:
            self._unsupported(module or sdpa.name, *problem)
            return
        prev = self.plan.kv.get(module)
        if prev is not None and not (prev.key.same(k) and prev.value.same(v)):
            self._unsupported(module, "one attention called with different KV quantization", HINT_LINEAR)
            return
        self.plan.kv[module] = kv

    def _nf4_float(self, dq: Node) -> torch.Tensor | None:
        """The float weight an NF4 ``dequantize`` of folded constants computes (kept float)."""
        if dq.target != torch.ops.quantkit.dequantize_nf4.default:  # e.g. a refused remainder group
            return None
        codes, table, scale = dq.args[:3]
        if not (isinstance(codes, Node) and codes.target == torch.ops.quantkit.unpack_int4.default
                and all(isinstance(a, Node) and a.op == "get_attr" for a in (codes.args[0], table, scale))):
            return None
        q = torch.ops.quantkit.unpack_int4.default(get_attr(self.gm, codes.args[0].target), bool(codes.args[1]))
        return torch.ops.quantkit.dequantize_nf4.default(q, get_attr(self.gm, table.target),
                                                         get_attr(self.gm, scale.target), dq.args[3], torch.float32)


def recorded_modules(gm: GraphModule, hf_modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """node name -> HF module, from the weight records of a loaded artifact's ``quantization.json``
    (``"<weight node> -> <consumer>"``; the weight node is the module path with ``_`` for ``.``).
    Empty for a graph with ``nn_module_stack`` (nothing needed) or without records."""
    doc = gm.meta.get("quantkit_recipe")
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), list):
        return {}
    by_weight = {f"{name.replace('.', '_')}_weight": name for name, mod in hf_modules.items()
                 if isinstance(getattr(mod, "weight", None), torch.Tensor)}
    out: dict[str, str] = {}
    for rec in doc["tensors"]:
        if not isinstance(rec, dict) or rec.get("kind") != "weight" or " -> " not in str(rec.get("node", "")):
            continue
        weight, consumers = str(rec["node"]).split(" -> ", 1)
        module = by_weight.get(weight)
        if module is not None:
            for consumer in consumers.split(", "):
                out.setdefault(consumer.strip(), module)
    return out


def read_graph(gm: GraphModule, hf_modules: dict[str, torch.nn.Module],
               cached_attention=schemes.kv_attention) -> Plan:
    """Read a converted graph against the HF model's modules (name -> module, e.g. built on
    the meta device); ``cached_attention(module)`` says whether the consumer quantizes that
    module's KV cache. Pure: ``gm`` is not modified."""
    return _Reader(gm, hf_modules, cached_attention).read()


def float_value(graph: torch.fx.Graph, dq: Node, memo: dict) -> Node:
    """The float value ``dq`` stands for, with every quantization before it removed: the
    quantize's input, through passthrough ops back to the first float value (new nodes)."""
    if dq in memo:
        return memo[dq]
    q = dq.args[0]
    src = q.args[0]
    if isinstance(src, Node) and src.target in PASSTHROUGH and isinstance(src.args[0], Node) \
            and src.args[0].target in ANY_DEQUANTIZE and isinstance(src.args[0].args[0], Node) \
            and src.args[0].args[0].target in ANY_QUANTIZE:
        inner = float_value(graph, src.args[0], memo)
        with graph.inserting_after(inner):
            copy = graph.node_copy(src, lambda n: inner if n is src.args[0] else n)
        src = copy
    memo[dq] = src
    return src

