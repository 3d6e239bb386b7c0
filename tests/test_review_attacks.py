"""A hostile operator's review of the first-study changes (issue 31): each attack mounted against the silos'
real code (data in the plan's label space, the schema a silo derives, its contribution, its sums through
secure aggregation's halves and a release gate with the default floors over a ledger kept on disk), first
where it worked, then refused.

- One silo's training records per class, from round-1 records over a second census: a plan naming a class
  nobody holds (or listing them in another order) made another census vector, so another census key, and the
  per-class records went out over another silo set. The census is keyed by the names of the classes held.
- One silo's answers to counting queries on its held-out images: the aggregator picks the model under
  secagg, so a state of its making is a new key, and sums of the held-out counts over sets that differ by one
  silo gave that silo's counts exactly. Held-out counts leave only in sums over every silo of the roster.
- Capped record counts at several record floors over one set give the counts away: one floor, the policy's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedlt.aggregation import evaluation_block, tail_guard
from fedlt.aggregation.gate import Floors, ReleaseGate, RepeatedRelease, Subject
from fedlt.aggregation.halves import SumAborted
from fedlt.aggregation.round_sums import RoundSums, SiloRound
from fedlt.data.federation import build_federation
from fedlt.methods import SiloContext
from fedlt.plan import EvaluationPlan, ModelSection
from privacy.secagg.layer import SecAggSum
from silo.releases import ReleaseLedger
from silo.stepping import expected_schema, round_contribution
from tests.consortium_harness import PLAN, RECIPE

NAMES = ["silo-a", "silo-b", "silo-c", "silo-d"]
VICTIM = "silo-a"
HELD = replace(PLAN, rounds=2, evaluation=EvaluationPlan(held_out=True))
FEDERATION = build_federation(replace(RECIPE, silos=4), seed=0)
LOCAL = dict(zip(NAMES, FEDERATION.silos, strict=True))


@pytest.fixture
def ledgers(tmp_path):
    """Each silo's release ledger on disk, kept across every sum of the test, as an agent keeps it."""
    made = {}
    for silo in NAMES:
        (tmp_path / silo).mkdir()
        made[silo] = ReleaseLedger(tmp_path / silo)
    return made


def layer_for(ledgers, *, roster: list[str] | None = NAMES) -> SecAggSum:
    """Secure aggregation whose silos each pass the gate an agent builds: the default floors, a roster of
    the four silos (None: whichever silos a sum lists, as if no field were kept to the whole roster), the
    silo's own ledger."""
    layer = SecAggSum()
    layer._gate = lambda silo, names: ReleaseGate(
        consortium="test-consortium",
        floors=Floors(),
        members=lambda: roster or names,
        ledger=ledgers[silo],
    )
    return layer


def contribute(layer, plan, state, silos, *, keyed_by_names: bool, held_out=None):
    """One round from `state` over `silos`, each silo's real contribution, a census first (the aggregator
    names none); the summed evaluation block."""
    method = plan.build_method()
    schema = expected_schema(plan, method, state, steps_model=False)
    contributions, records = [], {}
    for u in silos:
        data = LOCAL[u].in_label_space(plan.model.classes)
        slice_ = None if held_out is None else held_out[u]
        contributions.append(round_contribution(schema, method, state, data, slice_, SiloContext(1, u, 0)))
        records[u] = np.bincount(data.y, minlength=data.num_classes)
    layer.censuses.clear()
    summed = layer.aggregate(
        schema,
        contributions,
        silos=silos,
        trained_from=state.content_digest(),
        records=records,
        class_names=plan.model.classes if keyed_by_names else None,
    )
    _, _, counts = evaluation_block.split(schema, schema.flatten(dict(summed)))
    return counts, layer.zeroed


def with_extra_class(plan):
    return replace(plan, model=ModelSection("cnn-small", (1, 8, 8), (*plan.model.classes, "zz")))


@pytest.mark.parametrize("keyed_by_names", [False, True])
def test_a_plan_naming_a_class_nobody_holds_buys_no_second_census(ledgers, keyed_by_names):
    first = HELD.build_method().init_state(seed=0)
    counts_all, zeroed_all = contribute(layer_for(ledgers), HELD, first, NAMES, keyed_by_names=keyed_by_names)
    extra = with_extra_class(HELD)
    second = extra.build_method().init_state(seed=0)
    others = NAMES[1:]
    if not keyed_by_names:  # the census keyed by its vector: the attack as it worked
        counts_others, zeroed_others = contribute(
            layer_for(ledgers), extra, second, others, keyed_by_names=False
        )
        released = [c for c in range(10) if c not in {*zeroed_all, *zeroed_others}]
        got = np.array(counts_all.records)[released] - np.array(counts_others.records)[released]
        assert released
        assert got.tolist() == LOCAL[VICTIM].class_counts()[released].tolist()
        return
    with pytest.raises(RepeatedRelease, match="class presence"):
        contribute(layer_for(ledgers), extra, second, others, keyed_by_names=True)


def test_a_second_record_floor_is_refused_by_every_silo():
    """Σ min(nᵢ, r) over r bends at every nᵢ: a silo caps its census's records at its policy's floor only."""
    assert tail_guard.floor_problems(2, dp=False, accepted=2) == []
    assert tail_guard.floor_problems(0, dp=False, accepted=2) == []  # no floor: no capped counts go out
    assert "policy.min_class_records 2" in tail_guard.floor_problems(3, dp=False, accepted=2)[0]
    assert tail_guard.floor_problems(2, dp=False, accepted=0)  # a silo that accepts none
    assert tail_guard.floor_problems(5, dp=True, accepted=0) == []  # under DP every class is at the floor


def crafted(state, bump: float):
    """A state of the aggregator's making, labelled round 1 (no records asked): the same function as `state`
    up to a weight nudged by `bump`."""
    model = {name: t.clone() for name, t in state.model.items()}
    name = sorted(model)[0]
    model[name].view(-1)[0] += bump
    return replace(state, model=model, round=1)


def held_out_slices():
    test = FEDERATION.test
    return {u: test.subset(np.arange(k, len(test), len(NAMES))) for k, u in enumerate(NAMES)}


@pytest.mark.parametrize("whole_roster", [False, True])
def test_held_out_counts_leave_only_in_sums_over_every_silo_of_the_roster(ledgers, whole_roster):
    """Two states of the aggregator's making that predict alike, one summed over all four silos, the other
    over three: the difference was the fourth silo's held-out counts (here its class sizes, exactly); now
    the three keep theirs home."""
    slices = held_out_slices()
    state = crafted(HELD.build_method().init_state(seed=0), 0.0)
    roster = NAMES if whole_roster else None
    everyone, _ = contribute(
        layer_for(ledgers, roster=roster),
        HELD,
        crafted(state, 1e-4),
        NAMES,
        keyed_by_names=True,
        held_out=slices,
    )
    assert everyone.evaluated
    assert sum(everyone.total) == sum(len(s) for s in slices.values())
    three, _ = contribute(
        layer_for(ledgers, roster=roster),
        HELD,
        crafted(state, 2e-4),
        NAMES[1:],
        keyed_by_names=True,
        held_out=slices,
    )
    if not whole_roster:  # the attack as it worked
        difference = np.array(everyone.total) - np.array(three.total)
        assert difference.tolist() == slices[VICTIM].class_counts().tolist()
        return
    assert not three.evaluated
    assert sum(three.correct) == 0


def test_a_sum_that_loses_a_silo_after_held_out_counts_went_in_is_not_released(ledgers):
    """The counts go in only when every silo of the roster is listed; a dropout then ends the sum rather than
    release them over the rest (the round is retried over those left, who keep their counts home)."""
    method = HELD.build_method()
    state = method.init_state(seed=0)
    schema = expected_schema(HELD, method, state, steps_model=False)
    data = LOCAL[VICTIM].in_label_space(HELD.model.classes)
    mine = round_contribution(
        schema, method, state, data, held_out_slices()[VICTIM], SiloContext(1, VICTIM, 0)
    )
    layer = layer_for(ledgers)
    sums = RoundSums("r1", tuple(NAMES), schema, k_min=0, census=None)
    silo_round = SiloRound(
        layer.in_process(NAMES)[0][VICTIM],
        sums,
        mine.flat(),
        me=VICTIM,
        gate=layer._gate(VICTIM, NAMES),
        trained_from=Subject.fresh("contribution"),
    )
    silo_round.start()
    with pytest.raises(SumAborted, match=r"held-out counts .* some of those silos left: silo-d"):
        silo_round.may_release(tuple(NAMES[:3]))
