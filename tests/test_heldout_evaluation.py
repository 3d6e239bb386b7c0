"""Held-out evaluation where the aggregator steps the model: the silos' counts ride inside the round's sum.

What it must show: both ends derive one schema with the evaluation block (records in the first round only,
the block alone after the last round) and take it apart the same way; a consortium under secagg reports, for
every committed state including the last, exactly the per-class counts that state scores on the union of the
silos' held-out slices, with shot groups from the round-1 record counts; a silo without held-out data adds
zeros; and what the aggregator keeps holds sums only.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.config import ConsortiumConfig, load_consortium_config
from aggregator.store import Store
from aggregator.study_run import open_recorder
from fedlt.aggregation import Field, Schema, evaluation_block
from fedlt.aggregation.evaluation_block import CORRECT, RECORDS, TOTAL, HeldOutCounts
from fedlt.aggregation.gate import RepeatedRelease
from fedlt.aggregation.halves import EVALUATION_BOUND, EVALUATION_PHASE
from fedlt.config import render_toml
from fedlt.data.federation import build_federation
from fedlt.errors import ConfigError, ContributionError
from fedlt.methods import SiloContext
from fedlt.methods.state import unpack_state
from fedlt.metrics import ShotThresholds, accuracy_from_counts
from fedlt.plan import EvaluationPlan, RoundPlan
from fedlt.recorder import METRICS
from privacy.secagg.layer import SecAggSum
from silo.stepping import evaluation_counts, expected_schema, round_contribution
from tests.consortium_harness import AUDIT_KEY, PLAN, RECIPE, SILO_THREADS, Consortium, write_kit

HELD_OUT = replace(PLAN, evaluation=EvaluationPlan(held_out=True))
CLASSES = len(PLAN.model.classes)
ROUNDS = 2


# --- both ends agree on the block ----------------------------------------------------------------------


def test_both_ends_derive_one_schema_records_only_in_the_first_round_and_the_block_alone_after_the_last():
    plan = replace(HELD_OUT, rounds=ROUNDS)
    method = plan.build_method()
    initial = method.init_state(seed=0)
    later = replace(initial, round=1)
    final = replace(initial, round=ROUNDS)
    for state, names in (
        (initial, [CORRECT, TOTAL, RECORDS]),
        (later, [CORRECT, TOTAL]),
    ):
        silo = expected_schema(plan, method, state, steps_model=False)
        aggregator = plan.round_schema(
            method.schema(state), starting_round=state.round, remaining=method.remaining_rounds(state)
        )
        assert silo == aggregator
        assert [f.name for f in silo.fields] == [f.name for f in method.schema(state).fields] + names
        assert silo.phase == method.schema(state).phase  # the method's census, not a phase of its own
        assert not evaluation_block.only_evaluates(silo)
    last = expected_schema(plan, method, final, steps_model=False)
    assert [f.name for f in last.fields] == [CORRECT, TOTAL]
    assert evaluation_block.only_evaluates(last)
    assert last.phase == EVALUATION_PHASE
    # where silos step the model (ckks) they sum their counts apart: a signed block there is refused
    assert expected_schema(plan, method, initial, steps_model=True) == method.schema(initial)
    # without held-out evaluation, the method's schema alone, as before
    assert expected_schema(PLAN, method, initial, steps_model=False) == method.schema(initial)


def test_the_block_holds_exact_counts_that_no_dp_noises_and_only_records_are_per_class():
    method = PLAN.build_method()
    schema = evaluation_block.round_schema(method.schema(method.init_state(seed=0)), CLASSES, first=True)
    block = {f.name: f for f in schema.fields if f.name in evaluation_block.BLOCK}
    for f in block.values():
        assert (f.shape, f.frac_bits, f.bound, f.sensitivity, f.inverts) == (
            (CLASSES,),
            0,
            EVALUATION_BOUND,
            0.0,
            False,
        )
    assert {name for name, f in block.items() if f.per_class} == {RECORDS}
    with pytest.raises(ContributionError, match="collide"):
        evaluation_block.round_schema(Schema((Field(CORRECT, (2,), 1.0),)), 2, first=False)
    with pytest.raises(ContributionError, match="record counts"):
        evaluation_block.contribution(schema, None, torch.zeros(2 * CLASSES))


@settings(max_examples=40, deadline=None)
@given(
    silos=st.integers(2, 5),
    classes=st.integers(1, 6),
    first=st.booleans(),
    only=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_sum_of_contributions_splits_into_the_methods_sum_and_the_summed_counts(
    silos, classes, first, only, seed
):
    method = Schema(
        (Field("delta", (3,), 5.0), Field("count", (classes,), 100.0, frac_bits=0, per_class=True))
    )
    schema = evaluation_block.round_schema(None if only else method, classes, first=first)
    rng = np.random.default_rng(seed)
    parts, counts, records = [], [], []
    for _ in range(silos):
        trained = (
            None
            if only
            else method.contribution(
                delta=torch.from_numpy(rng.uniform(-5, 5, 3)),
                count=torch.from_numpy(rng.integers(0, 100, classes).astype(np.float64)),
            )
        )
        total = rng.integers(0, 50, classes)
        correct = np.minimum(rng.integers(0, 50, classes), total)
        held = rng.integers(0, 1000, classes)
        mine = evaluation_block.contribution(
            schema,
            trained,
            torch.from_numpy(np.concatenate([correct, total]).astype(np.float64)),
            torch.from_numpy(held.astype(np.float64)),
        )
        parts.append((trained, mine))
        counts.append((correct, total))
        records.append(held)
    summed = sum(mine.flat() for _, mine in parts)
    stripped, vector, held_out = evaluation_block.split(schema, summed)
    assert held_out == HeldOutCounts(
        tuple(int(v) for v in sum(c for c, _ in counts)),
        tuple(int(v) for v in sum(t for _, t in counts)),
        tuple(int(v) for v in sum(records)) if first and not only else None,
    )
    assert held_out.problems() == []
    if only:
        assert stripped is None
        assert vector.numel() == 0
    else:
        assert stripped == method
        assert torch.allclose(vector, sum(trained.flat() for trained, _ in parts))


def test_counts_no_honest_silos_could_sum_are_not_taken_for_metrics():
    assert HeldOutCounts((3, 1), (2, 1)).problems()
    assert HeldOutCounts((-1, 1), (2, 1)).problems()
    assert HeldOutCounts((1, 1), (2, 1), (-4, 3)).problems()


def test_a_silo_evaluates_the_starting_state_before_training_and_without_held_out_data_adds_zeros():
    plan = replace(HELD_OUT, rounds=ROUNDS)
    method = plan.build_method()
    federation = build_federation(RECIPE, seed=0)
    data, held_out = federation.silos[0], federation.test
    initial = method.init_state(seed=0)
    schema = expected_schema(plan, method, initial, steps_model=False)
    context = SiloContext(1, "silo-0", 0)
    mine = round_contribution(schema, method, initial, data, held_out, context)
    np.testing.assert_array_equal(
        torch.cat([mine.values[CORRECT], mine.values[TOTAL]]), evaluation_counts(method, initial, held_out)
    )
    np.testing.assert_array_equal(mine.values[RECORDS], data.class_counts())
    trained = method.local_round(initial, data, context)
    for f in method.schema(initial).fields:
        assert torch.equal(mine.values[f.name], trained.values[f.name]), f.name
    none = round_contribution(schema, method, initial, data, None, context)
    assert not none.values[CORRECT].any()
    assert not none.values[TOTAL].any()
    # after the last round: the counts alone, and no training (the method's fields are not asked for)
    final = replace(initial, round=ROUNDS)
    last = round_contribution(
        expected_schema(plan, method, final, steps_model=False), method, final, data, held_out, context
    )
    assert set(last.values) == {CORRECT, TOTAL}


# --- what an aggregator cannot ask for -----------------------------------------------------------------


def test_a_roundspec_asking_for_records_again_or_for_an_early_evaluation_only_round_is_refused():
    """The silo derives the schema from the state it checked and the signed plan: records are in the round
    from the initial state only (so a census set and the tail guard cover them), and the block alone only
    once no training round is left."""
    plan = replace(HELD_OUT, rounds=ROUNDS)
    method = plan.build_method()
    later = replace(method.init_state(seed=0), round=1)
    expected = expected_schema(plan, method, later, steps_model=False)
    records_again = evaluation_block.round_schema(method.schema(later), CLASSES, first=True)
    early_evaluation = evaluation_block.round_schema(None, CLASSES, first=False)
    assert records_again != expected
    assert early_evaluation != expected


def _evaluated(layer: SecAggSum, schema: Schema, silos: list[str], *, trained_from: str) -> torch.Tensor:
    """Each silo's counts (silo k: k + 1 right of 2k + 3 per class) summed by the layer's halves, after its
    trained `delta` where the schema has one (a training round's)."""
    trained = [f for f in schema.fields if f.name not in evaluation_block.BLOCK]
    contributions = [
        evaluation_block.contribution(
            schema,
            Schema(tuple(trained)).contribution(delta=torch.ones(1)) if trained else None,
            torch.tensor([k + 1.0, k + 1.0, 2 * k + 3.0, 2 * k + 3.0], dtype=torch.float64),
        )
        for k in (int(name[-1]) for name in silos)
    ]
    sums = layer.aggregate(schema, contributions, silos=silos, trained_from=trained_from)
    return sums.schema.flatten(sums)


def test_the_evaluation_of_a_state_is_released_over_one_silo_set_whatever_the_round_says():
    """Attack: have one state evaluated twice, over silo sets that differ by one silo, and subtract. Keyed by
    anything the aggregator can vary (here: a fresh key each time) it works and gives silo 2 less silo 3;
    keyed, as every silo keys it, by the state's content (the contribution's key, the evaluation-only round's
    too), the second release is refused, also when the first was a training round's."""
    schema = evaluation_block.round_schema(None, 2, first=False)
    unkeyed = SecAggSum()
    first = _evaluated(unkeyed, schema, ["silo-0", "silo-1", "silo-2"], trained_from="")
    second = _evaluated(unkeyed, schema, ["silo-0", "silo-1", "silo-3"], trained_from="")
    assert (first - second).tolist() == [-1.0, -1.0, -2.0, -2.0]  # silo 2's counts less silo 3's
    keyed = SecAggSum()
    training = evaluation_block.round_schema(Schema((Field("delta", (1,), 1.0),)), 2, first=False)
    _evaluated(keyed, training, ["silo-0", "silo-1", "silo-2"], trained_from="state-content")
    with pytest.raises(RepeatedRelease):
        _evaluated(keyed, schema, ["silo-0", "silo-1", "silo-3"], trained_from="state-content")


def test_the_stated_limit_states_of_the_aggregators_making_give_sums_over_other_sets():
    """What stays open under secagg (docs/threat-model.md), pinned: the aggregator chooses the model, so a
    state of its own making is a new key, and a sum over another set goes through; `total` does not change
    with the state, so the two sums' totals subtract to one silo's held-out class sizes less another's."""
    schema = evaluation_block.round_schema(None, 2, first=False)
    layer = SecAggSum()
    first = _evaluated(layer, schema, ["silo-0", "silo-1", "silo-2"], trained_from="state-a")
    second = _evaluated(layer, schema, ["silo-0", "silo-1", "silo-3"], trained_from="state-b")
    assert (first - second)[2:].tolist() == [-2.0, -2.0]


# --- consortium.toml: when, and which combinations ---------------------------------------------------------


def _with_evaluation(directory: Path, privacy: str = "secagg", **evaluation: object) -> Path:
    """The kit's consortium.toml with `[evaluation]` replaced and the layer chosen."""
    path = directory / "consortium.toml"
    tree = tomllib.loads(path.read_text())
    tree["consortium"]["privacy"] = privacy
    tree["evaluation"] = dict(evaluation)
    if privacy == "ckks":
        tree["ckks"] = {"key_holder": "silo-0"}
    path.write_text(render_toml(tree))
    return path


def test_held_out_evaluation_is_the_default_where_the_aggregator_steps_the_model_and_names_no_dataset(
    tmp_path,
):
    write_kit(tmp_path)
    for privacy in ("secagg", "plaintext"):
        config = load_consortium_config(_with_evaluation(tmp_path, privacy))
        assert config.plan.evaluation.held_out
        assert RoundPlan.from_toml(config.plan.to_toml(), "signed").evaluation.held_out  # silos read it
        assert config.silos_evaluate
    assert not load_consortium_config(_with_evaluation(tmp_path, "ckks")).plan.evaluation.held_out
    named = load_consortium_config(_with_evaluation(tmp_path, dataset="digits"))
    assert not named.plan.evaluation.held_out
    assert not named.silos_evaluate
    refused = load_consortium_config(_with_evaluation(tmp_path, held_out=False))
    assert not refused.plan.evaluation.held_out
    # built in code, a config evaluates on held-out data only when asked
    assert not ConsortiumConfig().plan.evaluation.held_out


@pytest.mark.parametrize(
    ("privacy", "evaluation", "message"),
    [
        ("ckks", {"held_out": True}, "already evaluate each state"),
        ("secagg", {"held_out": True, "dataset": "digits"}, "two evaluations of each state"),
        ("secagg", {"class_counts": [1] * CLASSES}, "shot groups come from the silos' summed training"),
    ],
)
def test_combinations_that_cannot_work_are_refused_with_the_way_out(tmp_path, privacy, evaluation, message):
    write_kit(tmp_path)
    with pytest.raises(ConfigError, match=message):
        load_consortium_config(_with_evaluation(tmp_path, privacy, **evaluation))


def test_a_restarted_aggregator_keeps_the_shot_groups_summed_in_round_1(tmp_path):
    write_kit(tmp_path)
    config = load_consortium_config(_with_evaluation(tmp_path))
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    try:
        counts = [150, 90, 60, 40, 30, 25, 20, 15, 10, 5]
        store.save_metrics(0, {"round": 0, "accuracy": 0.1, "train_counts": counts})
        recorder = open_recorder(config, tmp_path / "data", store)
    finally:
        store.close()
    assert recorder.test is None
    assert recorder.classes == PLAN.model.classes
    assert recorder.groups == ShotThresholds().groups(np.array(counts))
    assert [entry["round"] for entry in recorder.rounds] == [0]


# --- a consortium under secagg --------------------------------------------------------------------------


def _held_out_consortium(directory: Path) -> Consortium:
    """The harness's consortium with no dataset of the operator's (so held-out evaluation is on by default);
    silos 0 and 1 hold half of the recipe's test split each, silo 2 an empty slice."""
    consortium = Consortium.create(directory, rounds=ROUNDS, min_silos=3)
    path = directory / "consortium.toml"
    tree = tomllib.loads(path.read_text())
    del tree["evaluation"]
    path.write_text(render_toml(tree))
    slices = {0: (0, 2), 1: (1, 2), 2: (9_999, 10_000)}  # every 10,000th sample from the 10,000th: none
    for k, (part, parts) in slices.items():
        silo = consortium.silo_configs[k]
        tree = tomllib.loads(silo.read_text())
        tree["evaluation"] = {"part": part, "parts": parts}
        silo.write_text(render_toml(tree))
    return consortium


def _expected_records() -> np.ndarray:
    """The silos' summed training records per class, zeroed where fewer than k_min = 2 silos hold it."""
    counts = np.stack([silo.class_counts() for silo in build_federation(RECIPE, seed=0).silos])
    holders = (counts > 0).sum(axis=0)
    return np.where((holders > 0) & (holders < 2), 0, counts.sum(axis=0))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One run, read by the tests below."""
    consortium = _held_out_consortium(tmp_path_factory.mktemp("held-out"))
    try:
        consortium.start()
        assert consortium.wait_aggregator(timeout=240) == 0, "\n".join(consortium.output[-30:])
        consortium.stop()
        yield consortium
    finally:
        consortium.stop()


def test_a_secagg_consortium_reports_every_states_exact_held_out_counts_with_shot_groups(finished):
    store = finished.store()
    try:
        metrics = store.metrics_history()
        states = {
            r: unpack_state(data, r)
            for r, data in store._db.execute("SELECT round, data FROM states ORDER BY round").fetchall()
        }
        audit = store.audit_log()
    finally:
        store.close()
    assert sorted(states) == list(range(ROUNDS + 1)), "the evaluation-only round commits no state"
    assert [m["round"] for m in metrics] == list(range(ROUNDS + 1)), "every state, the initial and last too"

    records = _expected_records()
    assert metrics[0]["train_counts"] == records.tolist()
    groups = ShotThresholds().groups(records)
    assert all(groups[g] for g in ("many", "medium", "few"))
    header = json.loads((finished.data_dir / "run" / METRICS).read_text())["shot_groups"]
    assert {g: header[g]["classes"] for g in groups} == groups

    method = replace(PLAN, rounds=ROUNDS).build_method()
    union = build_federation(RECIPE, seed=0).test
    threads = torch.get_num_threads()
    torch.set_num_threads(SILO_THREADS)  # as the silos predict
    try:
        for entry in metrics:
            counts = evaluation_counts(method, states[entry["round"]], union).numpy().astype(np.int64)
            expected = accuracy_from_counts(counts[:CLASSES], counts[CLASSES:], groups)
            assert {k: entry[k] for k in expected} == expected, entry["round"]
            assert entry["many"] is not None
            assert entry["few"] is not None
    finally:
        torch.set_num_threads(threads)

    # FedAvg has no per-class field of its own: the records make round 1 take a census (once)
    assert [r.event for r in audit].count("census_taken") == 1
    evaluated = [r.detail for r in audit if r.event == "round_evaluated"]
    assert evaluated == [
        {
            "round": ROUNDS,
            "round_id": evaluated[0]["round_id"],
            "contributors": ["silo-0", "silo-1", "silo-2"],
        }
    ]
    assert "evaluated the last state on 0 held-out samples" in (finished.directory / "silo-2.log").read_text()


def test_the_aggregator_keeps_sums_of_the_counts_and_never_one_silos(finished):
    """Each silo's own counts (of the initial state, and its records) appear nowhere the aggregator writes;
    the round-1 sum does."""
    store = finished.store()
    try:
        written = json.dumps([r.detail for r in store.audit_log()]) + json.dumps(store.metrics_history())
        initial = unpack_state(store._db.execute("SELECT data FROM states WHERE round = 0").fetchone()[0], 0)
    finally:
        store.close()
    written += "\n".join(finished.output)
    method = PLAN.build_method()
    federation = build_federation(RECIPE, seed=0)
    for k, part in ((0, 0), (1, 1)):
        held_out = federation.test.subset(np.arange(part, len(federation.test), 2))
        own = evaluation_counts(method, initial, held_out).numpy().astype(np.int64).tolist()
        for vector in (own[:CLASSES], federation.silos[k].class_counts().tolist()):
            if len(set(vector)) > 1:  # a constant vector could be anything's
                assert json.dumps(vector) not in written, (k, vector)
    assert json.dumps(_expected_records().tolist()) in written
