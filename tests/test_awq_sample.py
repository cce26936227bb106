"""AWQ's row sample (quantkit.accuracy.rounding._sample): uniform over every calibration batch,
seeded, shard-invariant (what lets distributed AWQ equal one process), and used by AWQ's pass."""

from __future__ import annotations

import torch

from quantkit.accuracy.rounding._awq import _RowStats
from quantkit.accuracy.rounding._sample import RowSample


def _batches(sizes, channels=8, seed=0):
    """Batches whose rows carry their batch index in column 0 (the rest random)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, n in enumerate(sizes):
        x = torch.randn(n, channels, generator=g)
        x[:, 0] = b
        out.append(x)
    return out


def _sample(batches, keep, seed):
    s = RowSample(keep, seed)
    for x in batches:
        s.add(x)
    return s


def test_rows_come_from_every_batch_not_the_first_ones():
    batches = _batches([64] * 8)
    s = _sample(batches, keep=128, seed=0)
    assert len(s) == 128
    members = s.rows[:, 0].long().bincount(minlength=8)
    # expected 16 per batch; a first-batches sample (the old one) would hold batches 0 and 1 only
    assert int(members.min()) > 0, members.tolist()
    # every kept row is one of the rows offered, once
    everything = torch.cat(batches)
    assert all(bool((everything == r).all(1).any()) for r in s.rows)
    assert torch.unique(s.rows, dim=0).shape[0] == 128


def test_same_seed_same_sample_other_seed_other_sample():
    batches = _batches([50, 70, 30])
    a, b, c = (_sample(batches, 40, seed) for seed in (0, 0, 1))
    assert torch.equal(a.rows, b.rows) and torch.equal(a.keys, b.keys)
    assert not torch.equal(a.rows, c.rows)
    # fewer rows than asked for: all of them
    assert len(_sample(batches, 1000, 0)) == 150


def test_sample_is_uniform_over_rows():
    """Batch membership over many seeds against the rows' shares (chi-square, 2 d.o.f.)."""
    sizes = [10, 30, 60]
    batches = _batches(sizes)
    counts = torch.zeros(3)
    draws, keep = 300, 20
    for seed in range(draws):
        counts += _sample(batches, keep, seed).rows[:, 0].long().bincount(minlength=3)
    expected = torch.tensor(sizes, dtype=torch.float32) / sum(sizes) * draws * keep
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 13.8: the 0.999 quantile of chi-square(2). Sampling without replacement makes the statistic
    # smaller than a multinomial's, so this is conservative. Biased to the first batch fails it:
    assert chi2 < 13.8, (counts.tolist(), expected.tolist(), chi2)
    first = torch.tensor([10.0, 10.0, 0.0]) * draws  # the old sample: first rows, batch order
    assert float(((first - expected) ** 2 / expected).sum()) > 13.8


def test_sample_does_not_depend_on_batch_order_or_sharding():
    """Keys follow a batch's values: any order, or two shards merged (distributed AWQ), give one sample."""
    batches = _batches([40] * 6)
    whole = _sample(batches, 50, 3)
    assert torch.equal(_sample(batches[::-1], 50, 3).rows, whole.rows)
    rank0, rank1 = _sample(batches[:3], 50, 3), _sample(batches[3:], 50, 3)
    rank0.merge(rank1.keys, rank1.rows)
    assert torch.equal(rank0.rows, whole.rows) and torch.equal(rank0.keys, whole.keys)


def test_awq_row_stats_sample_every_batch_and_mean_over_all_rows():
    stats = _RowStats(keep=32, seed=0)
    batches = _batches([16] * 6, seed=5)
    for x in batches:
        stats(x.reshape(2, 8, 8))  # [batch, tokens, channels], as a linear's input
    rows = stats.sample.rows
    assert rows.shape == (32, 8) and int(rows[:, 0].long().unique().numel()) == 6
    everything = torch.cat(batches)
    torch.testing.assert_close(stats.abs_sum / stats.count, everything.abs().double().mean(0), rtol=1e-12, atol=0)
