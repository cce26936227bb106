"""quantkit's min-max observers against torchao's, plus merge, registry and error behaviour."""

import pytest
import torch
from torchao.quantization.pt2e import observer as ao

from quantkit import observers
from quantkit._errors import CalibrationError, ConvertError

SCHEMES = [
    (torch.uint8, torch.per_tensor_affine, None),
    (torch.int8, torch.per_tensor_symmetric, None),
    (torch.uint8, torch.per_tensor_symmetric, None),
    (torch.int8, torch.per_tensor_affine, None),
    (torch.int8, torch.per_tensor_affine, (-64, 63)),
    (torch.uint8, torch.per_tensor_symmetric, (0, 127)),
]


def _batches(seed=0, n=5, shape=(16, 32)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (i + 1) + 0.3 * i for i in range(n)]


def _pair(ours_cls, theirs_cls, dtype, qscheme, qrange, **kw):
    rng = {} if qrange is None else {"quant_min": qrange[0], "quant_max": qrange[1]}
    return ours_cls(dtype=dtype, qscheme=qscheme, **rng, **kw), theirs_cls(dtype=dtype, qscheme=qscheme, **rng, **kw)


@pytest.mark.parametrize("dtype,qscheme,qrange", SCHEMES)
@pytest.mark.parametrize("name", ["MinMaxObserver", "MovingAverageMinMaxObserver"])
def test_per_tensor_matches_torchao(name, dtype, qscheme, qrange):
    ours, theirs = _pair(getattr(observers, name), getattr(ao, name), dtype, qscheme, qrange)
    for x in _batches():
        ours(x)
        theirs(x)
    s1, z1 = ours.calculate_qparams()
    s2, z2 = theirs.calculate_qparams()
    assert torch.equal(s1, s2) and torch.equal(z1, z2), (s1, s2, z1, z2)


@pytest.mark.parametrize("qscheme", [torch.per_channel_symmetric, torch.per_channel_affine])
@pytest.mark.parametrize("ch_axis", [0, 1])
@pytest.mark.parametrize("name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"])
def test_per_channel_matches_torchao(name, qscheme, ch_axis):
    dtype = torch.int8
    ours = getattr(observers, name)(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme)
    theirs = getattr(ao, name)(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme)
    for x in _batches(shape=(8, 6, 5)):
        ours(x)
        theirs(x)
    s1, z1 = ours.calculate_qparams()
    s2, z2 = theirs.calculate_qparams()
    assert torch.equal(s1, s2) and torch.equal(z1.to(z2.dtype), z2)


def test_merge_halves_equals_whole_exactly():
    data = _batches(n=6)
    for cls, kw in [(observers.MinMaxObserver, {}), (observers.PerChannelMinMaxObserver, {"ch_axis": 1})]:
        whole, a, b = cls(**kw), cls(**kw), cls(**kw)
        for x in data:
            whole(x)
        for x in data[:3]:
            a(x)
        for x in data[3:]:
            b(x)
        a.merge(b)
        for t1, t2 in zip(whole.calculate_qparams(), a.calculate_qparams()):
            assert torch.equal(t1, t2)


def test_merge_moving_average_single_batches_is_exact():
    x1, x2 = _batches(n=2)
    a, b = observers.MovingAverageMinMaxObserver(averaging_constant=0.5), observers.MovingAverageMinMaxObserver(averaging_constant=0.5)
    a(x1)
    b(x2)
    a.merge(b)
    expected_min = x1.min() + 0.5 * (x2.min() - x1.min())
    assert torch.allclose(a.min_val, expected_min)


def test_merge_rejects_mismatched_observers():
    with pytest.raises(TypeError, match="cannot merge"):
        observers.MinMaxObserver().merge(observers.PerChannelMinMaxObserver())
    with pytest.raises(ValueError, match="different dtype"):
        observers.MinMaxObserver(dtype=torch.int8).merge(observers.MinMaxObserver(dtype=torch.uint8))


def test_empty_tensor_is_ignored():
    obs = observers.MinMaxObserver()
    obs(torch.empty(0, 4))
    assert not obs.calibrated
    obs(torch.tensor([1.0, -2.0]))
    obs(torch.empty(0))
    assert obs.min_val.item() == -2.0 and obs.max_val.item() == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cls", [observers.MinMaxObserver, observers.PerChannelMinMaxObserver])
def test_non_finite_raises_naming_the_node(cls, bad):
    obs = cls()
    obs.node_name = "relu_3 -> linear_4"
    x = torch.randn(4, 4)
    x[1, 2] = bad
    with pytest.raises(CalibrationError, match=r"relu_3 -> linear_4.*NaN or inf"):
        obs(x)


@pytest.mark.parametrize("value", [0.0, 5.0, -3.0])
@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric])
def test_constant_tensor_never_gives_zero_scale(value, qscheme):
    obs = observers.MinMaxObserver(dtype=torch.int8, qscheme=qscheme)
    obs(torch.full((10,), value))
    scale, zp = obs.calculate_qparams()
    assert scale.item() > 0
    from quantkit._qmath import fake_quantize

    rt = fake_quantize(torch.full((10,), value), scale, zp, obs.quant_min, obs.quant_max, torch.int8)
    assert torch.allclose(rt, torch.full((10,), value), atol=scale.item())


def test_custom_range_validation():
    obs = observers.MinMaxObserver(dtype=torch.int8, quant_min=-8, quant_max=7)
    obs(torch.linspace(-1, 1, 11))
    assert obs.calculate_qparams()[0].item() == pytest.approx(2 / 15)
    with pytest.raises(ValueError, match="must contain 0"):
        observers.MinMaxObserver(dtype=torch.int8, quant_min=-200, quant_max=7)
    with pytest.raises(ValueError, match="both quant_min and quant_max"):
        observers.MinMaxObserver(quant_min=0)


def test_uncalibrated_qparams_raise():
    obs = observers.MinMaxObserver()
    obs.node_name = "x -> linear"
    with pytest.raises(ConvertError, match="x -> linear.*seen no data"):
        obs.calculate_qparams()


def test_registry():
    assert observers.get("minmax") is observers.MinMaxObserver
    assert observers.get("Per-Channel-MinMax") is observers.PerChannelMinMaxObserver
    assert observers.get("moving_average_minmax") is observers.MovingAverageMinMaxObserver
    with pytest.raises(ValueError, match="unknown observer 'nope'.*minmax"):
        observers.get("nope")


def test_state_dict_round_trip_per_channel():
    a = observers.PerChannelMinMaxObserver(ch_axis=0)
    a(torch.randn(6, 3))
    b = observers.PerChannelMinMaxObserver(ch_axis=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.calculate_qparams()[0], b.calculate_qparams()[0])
