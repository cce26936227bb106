"""quantize_per_token: the fused kernel equals choose_qparams + quantize row by row."""

import pytest
import torch

from quantkit._qmath import choose_qparams, quantize
from quantkit.kernels import _quant
from quantkit.kernels import quantize_per_token


def _reference(x):
    rows = x.float().reshape(-1, x.shape[-1])
    q, s = [], []
    for r in rows:
        amax = r.abs().max()
        scale, zp = choose_qparams(-amax, amax, qscheme=torch.per_tensor_symmetric, dtype=torch.int8,
                                   quant_min=-128, quant_max=127)
        q.append(quantize(r, scale, zp, -128, 127, torch.int8))
        s.append(scale)
    return torch.stack(q).reshape(x.shape), torch.cat(s).reshape(*x.shape[:-1], 1)


RUNNERS = {"triton": _quant._launch, "cpu_op": quantize_per_token}


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("shape,dtype", [((5, 33), torch.float32), ((2, 3, 64), torch.float32),
                                         ((7, 100), torch.bfloat16), ((1, 1), torch.float32)])
def test_matches_reference(runner, shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x.view(-1)[0] = 0.0
    q, s = RUNNERS[runner](x)
    q_ref, s_ref = _reference(x)
    assert q.dtype == torch.int8 and s.shape == (*shape[:-1], 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1  # a product landing on .5 may round either way
    assert float((q != q_ref).float().mean()) < 0.01


def test_long_rows_take_the_two_pass_path(monkeypatch):
    monkeypatch.setattr(_quant, "_MAX_SINGLE_PASS_K", 16)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    q, s = _quant._launch(x)
    q_ref, s_ref = _reference(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_zero_rows_get_eps_scale_and_errors(runner):
    q, s = RUNNERS[runner](torch.zeros(2, 8))
    assert torch.all(q == 0) and torch.all(s == torch.finfo(torch.float32).eps)
    with pytest.raises(TypeError, match="floating point"):
        quantize_per_token(torch.zeros(2, 8, dtype=torch.int8))


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_decomposed_convention_matches_the_graph_ops(runner):
    """With ``**DECOMPOSED`` the kernel reproduces quantized_decomposed's choose_qparams_per_token
    + quantize_per_token (what convert emits and the CUDA lowering replaces), zero rows included."""
    from quantkit.kernels import DECOMPOSED

    x = torch.randn(4, 6, 48, generator=torch.Generator().manual_seed(2)) * 5
    x[0, 0] = 0.0  # absmax 0: the 1e-5 floor decides the scale
    x[1, 2] = 1e-7
    ops = torch.ops.quantized_decomposed
    s_ref, zp = ops.choose_qparams_per_token(x, torch.int8)
    q_ref = ops.quantize_per_token(x, s_ref, zp, -128, 127, torch.int8)
    q, s = RUNNERS[runner](x, **DECOMPOSED)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1
    assert float((q != q_ref).float().mean()) < 0.01
    with pytest.raises(ValueError, match="divisor must be > 0"):
        quantize_per_token(x, divisor=0.0)
