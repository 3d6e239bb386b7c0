import numpy as np
import pytest
import torch

from fedlt.aggregation import Field, Schema, make_layer
from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.data.arrays import LabeledData
from fedlt.methods import METHODS, ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.fedprox import FedProx, FedProxOptions
from fedlt.methods.local import train_local
from fedlt.methods.state import GlobalState, flatten, float_keys

SPEC = ModelSpec("cnn-small", (1, 8, 8), 10)
TRAIN = TrainConfig(local_epochs=1, batch_size=8, lr=0.1)


def _silo(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    return LabeledData(x, rng.integers(0, 10, n).astype(np.int64), tuple("0123456789"))


def _fedavg(**options):
    return FedAvg(options=FedAvgOptions(**options), train=TRAIN, model=SPEC, rounds=1)


def _fedprox(mu):
    return FedProx(options=FedProxOptions(mu=mu), train=TRAIN, model=SPEC, rounds=1)


def test_server_step_is_the_hand_computed_weighted_average():
    method = _fedavg()
    state = method.init_state(seed=0)
    keys = float_keys(state.model)
    w0 = flatten(state.model, keys).double()
    schema = method.schema(state)
    # two silos with 30 and 10 samples whose local models moved by d1 and d2
    d1 = torch.full_like(w0, 0.2)
    d2 = torch.linspace(-1, 1, len(w0), dtype=torch.float64)
    big = method.options.max_silo_samples  # silos send (n_k / N) Δw_k
    contributions = [
        schema.contribution(delta=30 / big * d1, n=30),
        schema.contribution(delta=10 / big * d2, n=10),
    ]
    new = method.server_step(state, PlaintextSum().aggregate(schema, contributions), ServerContext(1, 0))
    expected = w0 + (30 * d1 + 10 * d2) / 40
    assert new.round == 1
    assert torch.allclose(flatten(new.model, keys).double(), expected, atol=1e-6)
    assert new.model["encoder.0.weight"].dtype == torch.float32


def test_server_lr_scales_the_step():
    method = _fedavg(server_lr=0.5)
    state = method.init_state(seed=0)
    schema = method.schema(state)
    size = schema.fields[0].size  # "delta"
    c = schema.contribution(delta=torch.full((size,), 2.0 * 4 / method.options.max_silo_samples), n=4)
    new = method.server_step(state, PlaintextSum().aggregate(schema, [c]), ServerContext(1, 0))
    keys = float_keys(state.model)
    assert torch.allclose(flatten(new.model, keys) - flatten(state.model, keys), torch.full((size,), 1.0))


def test_local_round_contributes_weighted_delta_and_count():
    method = _fedavg()
    state = method.init_state(seed=0)
    data = _silo(24, 1)
    c = method.local_round(state, data, SiloContext(1, "silo-0", 0))
    assert float(c.values["n"]) == 24
    keys = float_keys(state.model)
    # the delta is n / N times the actual model change: redo the training and compare
    again = method.local_round(state, data, SiloContext(1, "silo-0", 0))
    assert torch.equal(c.values["delta"], again.values["delta"])
    assert c.values["delta"].abs().max() > 0
    model = method.load(state.model)
    assert torch.equal(flatten(model.state_dict(), keys), flatten(state.model, keys))


def test_local_round_depends_on_silo_and_round_randomness():
    method = _fedavg()
    state = method.init_state(seed=0)
    data = _silo(24, 1)
    a = method.local_round(state, data, SiloContext(1, "silo-0", 0)).values["delta"]
    b = method.local_round(state, data, SiloContext(2, "silo-0", 0)).values["delta"]
    assert not torch.equal(a, b)


def test_server_step_takes_only_sums():
    method = _fedavg()
    state = method.init_state(seed=0)
    c = method.local_round(state, _silo(10, 0), SiloContext(1, "silo-0", 0))
    with pytest.raises(TypeError, match="takes Sums from a privacy layer"):
        method.server_step(state, c.values, ServerContext(1, 0))


def test_server_step_refuses_sums_of_another_schema():
    method = _fedavg()
    state = method.init_state(seed=0)
    other = Schema((Field("n", (), 10.0),))
    sums = PlaintextSum().aggregate(other, [other.contribution(n=1)])
    with pytest.raises(Exception, match="another schema"):
        method.server_step(state, sums, ServerContext(1, 0))


def test_fedprox_with_zero_mu_is_fedavg_and_mu_pulls_towards_global():
    state = _fedavg().init_state(seed=0)
    data = _silo(40, 2)
    ctx = SiloContext(1, "silo-0", 0)
    plain = _fedavg().local_round(state, data, ctx).values["delta"]
    prox0 = _fedprox(0.0).local_round(state, data, ctx)
    strong = _fedprox(5.0).local_round(state, data, ctx)
    assert torch.equal(plain, prox0.values["delta"])
    assert strong.values["delta"].norm() < 0.8 * plain.norm()


def test_oversized_silo_is_refused():
    method = _fedavg(max_silo_samples=5)
    state = method.init_state(seed=0)
    with pytest.raises(Exception, match=r"must be in 1\.\.5"):
        method.local_round(state, _silo(6, 0), SiloContext(1, "silo-0", 0))


def test_digest_changes_with_any_weight():
    state = _fedavg().init_state(seed=0)
    model = {k: v.clone() for k, v in state.model.items()}
    model["classifier.bias"][0] += 1e-7
    assert GlobalState(0, model).digest() != state.digest()
    assert GlobalState(0, dict(state.model)).digest() == state.digest()


def test_registry_names():
    assert set(METHODS) == {"fedavg", "fedprox", "ccvr", "creff", "redgrape", "sfd", "dflfs", "balanced"}


def test_the_weight_scale_follows_the_summed_sample_count_and_caps_a_larger_silo():
    """N_r starts at max_silo_samples, then is twice the samples the last round summed; a silo with more
    samples than N_r reports N_r, with a weight of one."""
    method = _fedavg()
    state = method.init_state(seed=0)
    assert method.weight_scale(state) == method.options.max_silo_samples
    schema = method.schema(state)
    size = schema.fields[0].size
    sums = PlaintextSum().aggregate(
        schema, [schema.contribution(delta=torch.zeros(size), n=n) for n in (7, 13)]
    )
    following = method.server_step(state, sums, ServerContext(1, 0))
    assert method.weight_scale(following) == 40
    small = method.local_round(following, _silo(24, 1), SiloContext(2, "silo-0", 0))
    big = method.local_round(following, _silo(50, 1), SiloContext(2, "silo-0", 0))
    assert (float(small.values["n"]), float(big.values["n"])) == (24, 40)
    trained = method.local_round(following, _silo(24, 1), SiloContext(2, "silo-0", 0)).values["delta"]
    again = method.local_round(state, _silo(24, 1), SiloContext(2, "silo-0", 0)).values["delta"]
    # the same training from the same model: only the weight differs, 24/40 against 24/max_silo_samples
    assert torch.allclose(trained * 40, again * method.options.max_silo_samples)


@pytest.mark.parametrize("later", [False, True], ids=["first round", "a later round"])
def test_a_secure_step_is_the_plaintext_step_within_the_codecs_stated_bound(later):
    """The compact ring changes the numbers: each silo's (n_k / N_r)·Δw_k is rounded to 2^-(f+1), so the
    step is off by at most N_r / Σn_k · K · 2^-(f+1), per element. N_r is max_silo_samples in the first round,
    2 Σ n_k after it: the later round's bound is about a thousand times tighter here."""
    method = _fedavg()
    state = method.init_state(seed=0)
    if later:
        schema = method.schema(state)
        size = schema.fields[0].size
        counts = [schema.contribution(delta=torch.zeros(size), n=n) for n in (30, 40, 50)]
        state = method.server_step(state, PlaintextSum().aggregate(schema, counts), ServerContext(1, 0))
    schema = method.schema(state)
    contributions = [
        method.local_round(state, _silo(n, k), SiloContext(1, f"silo-{k}", 0))
        for k, n in enumerate((30, 40, 50))
    ]
    steps = {
        name: method.server_step(state, layer.aggregate(schema, contributions), ServerContext(1, 0))
        for name, layer in {"plaintext": PlaintextSum(), "secagg": make_layer("secagg")}.items()
    }
    keys = float_keys(state.model)
    error = flatten(steps["secagg"].model, keys).double() - flatten(steps["plaintext"].model, keys).double()
    f = schema.fields[0].frac_bits  # 3 silos: 32-bit words at the field's own 24 bits
    bound = method.weight_scale(state) / 120 * 3 * 2.0 ** -(f + 1) + 1e-7  # + float32 rounding of the model
    assert 0 < error.abs().max().item() <= bound
    assert bound < (1e-5 if later else 1e-3)


@pytest.mark.parametrize(
    ("samples", "epochs", "min_steps", "steps"),
    [(100, 2, 0, 8), (100, 2, 5, 8), (10, 2, 20, 20), (40, 1, 5, 6), (33, 3, 7, 8)],
)
def test_a_small_silo_trains_more_epochs_until_it_has_taken_min_steps(samples, epochs, min_steps, steps):
    """Whole epochs, never fewer than `local_epochs`: 100 samples in batches of 32 take 4 steps an epoch."""
    config = TrainConfig(local_epochs=epochs, batch_size=32 if samples != 10 else 8, min_steps=min_steps)
    model = torch.nn.Linear(3, 2)
    taken = []
    x, y = torch.randn(samples, 3), torch.randint(0, 2, (samples,))
    train_local(model, x, y, config, torch.Generator().manual_seed(0), after_step=lambda: taken.append(1))
    assert len(taken) == steps
