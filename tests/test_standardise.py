"""A table study's opening round: the pooled moments of every numeric column from summed contributions,
written into the model's Standardise layer before any method trains, and nothing of it under DP."""

import numpy as np
import pytest
import torch

from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.data.arrays import LabeledData
from fedlt.data.table import Column, TableSchema
from fedlt.dp import DPSettings
from fedlt.errors import ContributionError
from fedlt.methods import METHODS, ModelSpec, ServerContext, SiloContext, TrainConfig, standardise
from fedlt.models.standardise import standardise_layer
from tests.test_review_attacks import NAMES, layer_for
from tests.test_review_attacks import ledgers as ledgers  # a fixture, found by its name

SCHEMA = TableSchema(
    "outcome",
    (
        Column("age", "numeric", 0.0, 100.0),
        Column("amount", "numeric", 0.0, 1000.0, missing=True),
        Column("ward", "categorical", categories=("A", "B")),
    ),
)
LAYOUT = SCHEMA.layout()  # age, amount, amount:missing, ward=A, ward=B
CLASSES = ("no", "yes")


def silo(rng: np.random.Generator, rows: int, missing: float) -> LabeledData:
    x = np.zeros((rows, len(LAYOUT.features)), dtype=np.float32)
    x[:, 0] = rng.beta(2, 5, rows)
    gone = rng.random(rows) < missing
    x[:, 1] = np.where(gone, 0.0, rng.beta(5, 2, rows))
    x[:, 2] = gone
    x[np.arange(rows), 3 + rng.integers(0, 2, rows)] = 1
    return LabeledData(x, rng.integers(0, 2, rows).astype(np.int64), CLASSES, "memory")


SILOS = [
    silo(np.random.default_rng(k), rows, missing)
    for k, (rows, missing) in enumerate([(40, 0.1), (7, 0.0), (25, 0.5)])
]


def method(name: str = "fedavg", *, dp: DPSettings | None = None, rounds: int = 2):
    spec = ModelSpec("mlp", (len(LAYOUT.features),), len(CLASSES), table=LAYOUT)
    return METHODS[name](
        options=METHODS[name].Options(), train=TrainConfig(batch_size=8), model=spec, rounds=rounds, dp=dp
    )


def step(m, state, silos=SILOS):
    contributions = [
        m.local_round(state, d, SiloContext(state.round + 1, f"silo-{k}", 0)) for k, d in enumerate(silos)
    ]
    sums = PlaintextSum().aggregate(m.schema(state), contributions)
    return m.server_step(state, sums, ServerContext(state.round + 1, 0))


def pooled(column: int, indicator: int | None) -> tuple[float, float]:
    x = np.concatenate([d.x for d in SILOS]).astype(np.float64)
    kept = x[:, column] if indicator is None else x[x[:, indicator] == 0, column]
    return kept.mean(), kept.std()


@pytest.mark.parametrize("name", ["fedavg", "balanced", "ccvr", "creff"])
def test_the_opening_round_fills_the_layer_with_the_pooled_moments_before_any_training(name):
    m = method(name)
    state = m.init_state(seed=0)
    assert m.opens(state)
    assert not m.trains(state)
    assert m.schema(state).phase == standardise.PHASE
    planned = m.remaining_rounds(state)
    opened = step(m, state)
    assert opened.round == 1
    assert not m.opens(opened)
    assert m.remaining_rounds(opened) == planned - 1
    assert m.trained_rounds(opened) == 0
    prefix, _ = standardise_layer(m.working_model())
    for position, (column, indicator) in enumerate([(0, None), (1, 2)]):
        mean, std = pooled(column, indicator)
        assert opened.model[f"{prefix}mean"][position].item() == pytest.approx(mean, rel=1e-6)
        assert opened.model[f"{prefix}scale"][position].item() == pytest.approx(1 / std, rel=1e-5)
    # every other entry of the model is the initial one: the opening round trains nothing
    changed = {k for k in state.model if not torch.equal(state.model[k], opened.model[k])}
    assert changed == {f"{prefix}mean", f"{prefix}scale", f"{prefix}ready"}
    trained = step(m, opened)
    assert m.schema(opened).phase != standardise.PHASE
    assert trained.round == 2
    assert m.trained_rounds(trained) in (0, 1)  # balanced's priors round trains nothing either


def test_the_layer_standardises_and_imputes_a_missing_value_at_the_mean():
    m = method()
    opened = step(m, m.init_state(seed=0))
    layer = standardise_layer(m.load(opened.model))[1]
    x = torch.from_numpy(SILOS[0].x[:4].copy())
    x[0, 2], x[0, 1] = 1.0, 0.0  # amount missing
    z = layer(x)
    mean, std = pooled(0, None)
    assert z[:, 0].double().numpy() == pytest.approx((x[:, 0].double().numpy() - mean) / std, rel=1e-5)
    assert z[0, 1].item() == 0.0
    assert torch.equal(z[:, 2:], x[:, 2:])  # indicator and one-hot pass unchanged


def test_an_exported_state_carries_the_statistics_so_the_model_standardises_alone():
    m = method()
    opened = step(m, m.init_state(seed=0))
    fresh = method().network(0)
    fresh.load_state_dict(opened.model)
    prefix, layer = standardise_layer(fresh)
    assert bool(layer.ready)
    assert torch.equal(layer.mean, opened.model[f"{prefix}mean"])


def test_a_sum_without_a_value_of_some_column_fails_the_round_rather_than_dividing_by_zero():
    m = method()
    state = m.init_state(seed=0)
    empty = LabeledData(
        np.zeros((3, len(LAYOUT.features)), dtype=np.float32), np.zeros(3, dtype=np.int64), CLASSES
    )
    empty.x[:, 2] = 1  # every amount missing
    with pytest.raises(ContributionError, match=r"no value of numeric column\(s\) \[1\]"):
        step(m, state, [empty])


def test_the_moments_are_released_only_in_sums_over_the_whole_roster():
    assert all(f.whole_roster for f in standardise.schema(2).fields)


def test_under_dp_no_opening_round_runs_and_features_keep_the_schemas_scaling():
    m = method(dp=DPSettings(enabled=True, epsilon=8.0))
    state = m.init_state(seed=0)
    assert not m.opens(state)
    assert m.schema(state).phase != standardise.PHASE
    assert m.remaining_rounds(state) == 2


def test_image_studies_have_no_opening_round():
    m = METHODS["fedavg"](
        options=METHODS["fedavg"].Options(),
        train=TrainConfig(),
        model=ModelSpec("cnn-small", (1, 8, 8), 4),
        rounds=1,
    )
    assert not m.opens(m.init_state(seed=0))
    assert m.remaining_rounds(m.init_state(seed=0)) == 1


@pytest.mark.parametrize("whole_roster", [False, True])
def test_a_silos_moments_cannot_be_had_by_differencing_two_opening_rounds(ledgers, whole_roster):
    """The aggregator makes two initial states (any seed makes a fresh one, and a fresh release key), sums
    the opening round over all four silos from one and over three from the other: the difference was the
    fourth silo's moments, exactly. The moments leave only in sums over the whole roster, so the three keep
    theirs home and the round sums nothing."""
    local = dict(zip(NAMES, [*SILOS, silo(np.random.default_rng(9), 12, 0.2)], strict=True))
    m = method()

    def opening(seed: int, silos: list[str]) -> dict:
        state = m.init_state(seed=seed)
        contributions = [m.local_round(state, local[u], SiloContext(1, u, 0)) for u in silos]
        layer = layer_for(ledgers, roster=NAMES if whole_roster else None)
        return dict(
            layer.aggregate(m.schema(state), contributions, silos=silos, trained_from=state.content_digest())
        )

    everyone, three = opening(0, NAMES), opening(1, NAMES[1:])
    victim = standardise.moments(local[NAMES[0]].x, LAYOUT.numeric, LAYOUT.indicators)
    if not whole_roster:  # the attack as it worked
        for name, value in victim.items():
            assert torch.allclose(everyone[name] - three[name], value, atol=1e-5)
        return
    assert all(bool((three[name] == 0).all()) for name in victim)
    assert bool((everyone[standardise.COUNT] > 0).all())
