"""FP8Quantizer(kv_cache=...) on a tiny random Llama: q/dq on K after the rotary embedding and on V
at every SDPA, scales equal to the calibrated amax of exactly those tensors (float64 reference)."""

import pytest
import torch

import quantkit
from quantkit.quantizers import FP8Quantizer

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten
_AO = torch.ops.torchao


class _Last(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaModel(cfg).eval()
    model.config.use_cache = False
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    return _Last(model).eval(), ids


def _upstream(node, depth=12):
    """Ops feeding ``node`` (breadth first, ``depth`` levels)."""
    seen, todo = [], [node]
    for _ in range(depth):
        todo = [a for n in todo for a in n.all_input_nodes if a.op == "call_function"]
        seen += todo
    return seen


def test_kv_cache_quantizes_rotated_keys_and_values(llama):
    model, ids = llama
    gm = quantkit.capture(model, (ids[:4],))
    prepared = quantkit.prepare(gm, FP8Quantizer(kv_cache="fp8_e4m3"))
    quantkit.calibrate(prepared, [ids[:4], ids[4:]], progress=False)
    conv = quantkit.convert(prepared)
    sdpa = [n for n in conv.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 1
    roles = {}
    for role, arg in (("key", sdpa[0].args[1]), ("value", sdpa[0].args[2])):
        assert arg.target == _AO.dequantize_affine_float8_non_decomposed.default, role
        q = arg.args[0]
        assert q.target == _AO.quantize_affine_float8_non_decomposed.default and q.args[2] == torch.float8_e4m3fn
        roles[role] = (q.args[0], float(conv.get_buffer(q.args[1].target)))
    # rotary: k * cos + rotate_half(k) * sin feeds the key's quantize, not the value's
    key_ops, value_ops = _upstream(roles["key"][0]), _upstream(roles["value"][0])
    assert any(n.target == aten.cat.default for n in key_ops)  # rotate_half
    assert not any(n.target == aten.cat.default for n in value_ops)
    records = {r["kv_cache"]: r for r in conv.meta["quantkit_qparams"] if "kv_cache" in r}
    assert set(records) == {"key", "value"}
    # reference: the amax of the tensors the KV observers watched (the float graph's rotated K and
    # V), over both calibration batches, / 448, from float64 values
    modules = dict(prepared.named_modules(remove_duplicate=False))
    watched = {n: modules[n.target].kv_role for n in prepared.graph.nodes
               if n.op == "call_module" and getattr(modules[n.target], "kv_role", None)}
    assert sorted(watched.values()) == ["key", "value"]
    seen = {role: [] for role in roles}
    interp = torch.fx.Interpreter(prepared)
    orig = interp.run_node

    def run_node(n):
        out = orig(n)
        if n in watched:
            seen[watched[n]].append(out.detach().double().abs().max())
        return out

    interp.run_node = run_node
    with torch.no_grad():
        for batch in (ids[:4], ids[4:]):
            interp.run(batch)
    for role, (_, scale) in roles.items():
        ref = float((max(seen[role]) / 448).float())
        assert scale == ref == records[role]["scale"][0], (role, scale, ref)
