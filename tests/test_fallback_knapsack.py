"""The fallback's search over float layers (issue 28: the 45 s search and the 0.30x artifact):
``_Search.cheapest`` keeps float the layers with the most skip-one gain per cost, scoring the
predicted number of them first, and returns kept layers to int8 where the measured margin allows.

The scores here come from a model written in the test: each float layer adds its gain to the all-int8
score, optionally with an interaction term, so the cheapest set is known by brute force.
"""

import itertools

import pytest

from quantkit.accuracy._fallback import _Search
from quantkit.accuracy._sensitivity import LayerSensitivity, SensitivityMode, SensitivityReport
from quantkit.pipeline._layers import Layer

BASE, REFERENCE = 0.990, 1.0


class _Variants:
    def variant(self, names):
        return frozenset(names)


class _Evaluator:
    """score(set of float layers) = BASE + sum of gains - overlap * (pairs among them)."""

    reference = REFERENCE

    def __init__(self, gains, overlap=0.0):
        self.gains, self.overlap, self.calls = gains, overlap, 0

    def score(self, names):
        self.calls += 1
        k = len(names)
        return min(REFERENCE, BASE + sum(self.gains[n] for n in names) - self.overlap * k * (k - 1) / 2)


def _ranking(gains, noise=None):
    noise = noise or {}
    entries = [LayerSensitivity(Layer(n, "linear", n, "Linear"), BASE + g + noise.get(n, 0.0), g + noise.get(n, 0.0))
               for n, g in gains.items()]
    entries.sort(key=lambda e: -e.sensitivity)
    return SensitivityReport(SensitivityMode.SKIP_ONE, REFERENCE, BASE, entries)


# four big layers (cost 4) with big gains and six small ones (cost 1): per cost, small ones win
GAINS = {"ffn0": 0.0030, "ffn1": 0.0028, "ffn2": 0.0026, "ffn3": 0.0010,
         "v0": 0.0012, "v1": 0.0011, "v2": 0.0010, "v3": 0.0009, "k0": 0.0002, "k1": 0.0001}
COSTS = {n: 4.0 if n.startswith("ffn") else 1.0 for n in GAINS}


def _cheapest_by_brute_force(gains, costs, need, score):
    best = None
    for k in range(len(gains) + 1):
        for combo in itertools.combinations(gains, k):
            if score(combo) >= need and (best is None or sum(costs[n] for n in combo) < best[0]):
                best = (sum(costs[n] for n in combo), set(combo))
    return best


@pytest.mark.parametrize("budget", [0.008, 0.006, 0.004, 0.002])
def test_cheapest_meets_the_budget_near_the_brute_force_cost_in_few_scorings(budget):
    ev = _Evaluator(GAINS)
    search = _Search(_Variants(), ev, budget)
    keep = search.cheapest(_ranking(GAINS), COSTS)
    target = REFERENCE - budget
    assert ev.score(keep) >= target - 1e-12
    cost, _ = _cheapest_by_brute_force(GAINS, COSTS, target - 1e-12, ev.score)
    # a greedy knapsack: the optimum or near it (within 15% here), never below it
    assert cost <= sum(COSTS[n] for n in keep) <= 1.15 * cost
    # the first prefix scored is the predicted one: fewer scorings than layers, and at most
    # one more than the sensitivity-order search (1, 2, 4, ... layers, bisect, a return to int8 per kept layer)
    old = _Search(_Variants(), _Evaluator(GAINS), budget)
    old.prune(old.shortest_prefix([e.layer.name for e in _ranking(GAINS).ranked]))
    assert len(search.scores) < len(GAINS) and len(search.scores) <= len(old.scores) + 1, search.trials


def test_the_old_prefix_search_keeps_more_bytes():
    """The same budget by the sensitivity order alone (shortest_prefix + prune) costs more."""
    budget = 0.004
    ev = _Evaluator(GAINS)
    old = _Search(_Variants(), ev, budget)
    by_rank = old.prune(old.shortest_prefix([e.layer.name for e in _ranking(GAINS).ranked]))
    new = _Search(_Variants(), ev, budget).cheapest(_ranking(GAINS), COSTS)
    assert sum(COSTS[n] for n in new) < sum(COSTS[n] for n in by_rank)


def test_gains_that_do_not_add_up_still_meet_the_budget():
    """Overlapping errors (each extra float layer recovers less): the prediction falls short, the
    search walks up until a real score meets the budget; noisy gains on the ranking's one batch too."""
    ev = _Evaluator(GAINS, overlap=0.0002)
    noise = {"ffn3": 0.001, "v0": -0.0008, "k1": 0.0005}
    search = _Search(_Variants(), ev, 0.004)
    keep = search.cheapest(_ranking(GAINS, noise), COSTS)
    assert ev.score(keep) >= REFERENCE - 0.004 - 1e-12
    assert keep and len(keep) < len(GAINS)
    # every configuration decided on was scored for real, each once
    assert len(search.trials) == len(search.scores)


def test_unknown_costs_count_as_the_typical_layer_and_unhelpful_layers_come_last():
    gains = {"a": 0.004, "b": 0.003, "c": 0.0, "d": -0.001}
    ev = _Evaluator({**gains, "c": 0.0, "d": 0.0})
    search = _Search(_Variants(), ev, 0.004)
    keep = search.cheapest(_ranking(gains), {"a": 2.0})  # b, c, d: unknown cost
    assert set(keep) == {"a", "b"}
