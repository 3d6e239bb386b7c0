import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from fedlt.data.arrays import LabeledData
from fedlt.dp import DPSettings
from fedlt.methods import ModelSpec, SiloContext, TrainConfig
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.fedprox import FedProx, FedProxOptions
from fedlt.methods.local import train_local
from privacy.dp.ledger import Budget, PrivacyLedger
from privacy.dp.noise import SecureRandom
from privacy.dp.silo_privacy import SiloPrivacy

SPEC = ModelSpec("cnn-small", (1, 8, 8), 10)
# Opacus' per-parameter attributes, and the clipped sum its optimizer keeps on each parameter
OPACUS_ATTRS = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample", "summed_grad")


class CountingRandom(SecureRandom):
    """The silo's CSPRNG, noting the size of every Poisson-sampled batch drawn from it."""

    def __init__(self, key: bytes | None = None) -> None:
        super().__init__(key)
        self.batch_sizes: list[int] = []

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        mask = super().bernoulli(count, p)
        self.batch_sizes.append(int(mask.sum()))
        return mask


class FakeRound:
    """A `PrivateRound` with a fixed σ and no ledger, for exact control over clipping and noise."""

    def __init__(
        self, sigma: float = 0.0, max_grad_norm: float = 1.0, rng: SecureRandom | None = None
    ) -> None:
        self.sigma = sigma
        self.max_grad_norm = max_grad_norm
        self.rng = rng if rng is not None else CountingRandom.seeded("fake-round")
        self.admitted: list[tuple[float, int]] = []

    def admit_sgd(self, *, sample_rate: float, steps: int) -> float:
        self.admitted.append((sample_rate, steps))
        return self.sigma

    def noise_stream(self) -> Callable[[int, float], torch.Tensor]:
        stream = self.rng.spawn()
        return lambda count, std: torch.zeros(count) if std == 0 else stream.gaussian((count,), std)

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        return self.rng.bernoulli(count, p)


def _tiny(seed: int = 0) -> nn.Module:
    """A linear model on 8×8 images, for the tests of sampling and randomness rather than of the network."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(rng.integers(0, 10, n).astype(np.int64))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _train(model, x, y, config, private=None, **kwargs) -> torch.Tensor:
    """The parameter change of one call of train_local."""
    before = _flat(model)
    train_local(model, x, y, config, torch.Generator().manual_seed(0), private=private, **kwargs)
    return _flat(model) - before


def _zero_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-record losses whose every gradient is zero: what moves the model is the noise alone."""
    return 0.0 * model(x).sum(dim=1)


def _dp_settings(**overrides) -> DPSettings:
    values = {"enabled": True, "epsilon": 50.0, "delta": 1e-5, "noise_multiplier": 1.0, "count_noise": 10.0}
    return DPSettings(**(values | overrides))


def _silo(settings: DPSettings, rng: SecureRandom, rounds: int = 1) -> SiloPrivacy:
    method = FedAvg(options=FedAvgOptions(), train=TrainConfig(), model=SPEC, rounds=rounds)
    ledger = PrivacyLedger(Budget(settings.epsilon, settings.delta))
    return SiloPrivacy(settings, method=method, ledger=ledger, rng=rng)


# ---------------------------------------------------------------- clipping


def test_per_sample_clipping_bounds_an_outliers_pull():
    """Guards per-sample clipping: one record scaled by 1e4 moves a plain SGD step by orders of magnitude,
    but a DP step (σ = 0, momentum 0) moves by at most lr·C·|batch| / expected batch size."""
    x, y = _data(16, 0)
    x[3] *= 1e4
    config = TrainConfig(batch_size=16, lr=0.1)  # rate 1: the batch is every record, the outlier with them
    private = FakeRound(sigma=0.0, max_grad_norm=1.0)
    dp_step = _train(SPEC.build(0), x, y, config, private)
    plain_step = _train(SPEC.build(0), x, y, config)
    assert private.rng.batch_sizes == [16]
    assert dp_step.norm() <= 0.1 * 1.0 * 16 / 16 + 1e-6
    assert dp_step.norm() > 0  # the records did move it
    assert plain_step.norm() > 100 * 0.1 * 1.0


def test_clipped_records_move_the_model_by_exactly_the_clip_norm():
    """Guards the clip itself (not just a bound): a single record whose gradient is far above C moves one
    DP step by lr·C exactly; with Poisson batches the total over steps stays within lr·C·Σ|batch| / (q·n)."""
    x, y = _data(1, 1)
    one = _train(SPEC.build(0), x * 1e4, y, TrainConfig(batch_size=1, lr=0.1), FakeRound(0.0, 0.5))
    assert one.norm().item() == pytest.approx(0.1 * 0.5, rel=1e-4)

    x, y = _data(24, 2)
    x *= 1e4  # every record's gradient is clipped
    private = FakeRound(0.0, 0.5, CountingRandom.seeded(3))
    total = _train(_tiny(), x, y, TrainConfig(batch_size=6, lr=0.1), private)
    assert total.norm() <= 0.1 * 0.5 * sum(private.rng.batch_sizes) / 6 + 1e-6


def test_without_clipping_or_noise_a_dp_step_is_a_plain_sgd_step():
    """Guards the scaling of the privatised gradient: with σ = 0, a clip norm nothing reaches and every record
    in the batch (q = 1), DP-SGD must be exactly SGD on the mean loss (no stray factor of the batch size)."""
    x, y = _data(12, 4)
    config = TrainConfig(batch_size=12, lr=0.1, local_epochs=2)
    private = FakeRound(sigma=0.0, max_grad_norm=1e6)
    dp = _train(SPEC.build(0), x, y, config, private)
    plain = _train(SPEC.build(0), x, y, config)
    assert private.rng.batch_sizes == [12, 12]
    assert plain.abs().max() > 1e-3
    torch.testing.assert_close(dp, plain, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- noise


def test_noise_std_is_lr_sigma_c_over_expected_batch_size():
    """Guards the noise level: with zero gradients, T steps move each weight by N(0, T·(lr·σ·C / (q·n))²);
    dividing by each batch's actual size (or forgetting C) would miss by far more than 15 %."""
    x, y = _data(8, 5)
    sigma, clip, lr = 2.0, 0.5, 0.1
    private = FakeRound(sigma, clip, CountingRandom.seeded(11))
    change = _train(SPEC.build(0), x, y, TrainConfig(batch_size=4, lr=lr), private, loss=_zero_gradient)
    steps = len(private.rng.batch_sizes)
    assert steps == 2
    assert sorted(private.rng.batch_sizes) != [4, 4]  # the batches' sizes differ from the expected one
    expected = lr * sigma * clip / 4 * math.sqrt(steps)
    assert change.std().item() == pytest.approx(expected, rel=0.15)
    assert abs(change.mean().item()) < 0.05 * expected


def test_noise_is_fresh_unless_seeded():
    """Guards the noise source: two runs from the same start with fresh CSPRNGs differ; two runs from the
    same test seed are identical, and another seed differs."""
    x, y = _data(8, 6)
    config = TrainConfig(batch_size=4, lr=0.1)

    def run(rng: SecureRandom) -> torch.Tensor:
        model = _tiny()
        train_local(model, x, y, config, torch.Generator().manual_seed(0), private=FakeRound(1.0, 1.0, rng))
        return _flat(model)

    assert not torch.equal(run(SecureRandom()), run(SecureRandom()))
    assert torch.equal(run(SecureRandom.seeded(7)), run(SecureRandom.seeded(7)))
    assert not torch.equal(run(SecureRandom.seeded(7)), run(SecureRandom.seeded(8)))


def test_noise_and_sampling_do_not_use_torch_global_generator():
    """Guards against noise or batches drawn from torch's global generator (a statistical one, whose state
    a seed or its outputs give away): seeding it does not make two runs equal, and training neither
    advances nor replaces its state."""
    x, y = _data(8, 7)
    config = TrainConfig(batch_size=4, lr=0.1)
    saved = torch.get_rng_state()
    finals = []
    try:
        for _ in range(2):
            model = _tiny()
            torch.manual_seed(1234)
            before = torch.get_rng_state()
            private = FakeRound(1.0, 1.0, SecureRandom())
            train_local(model, x, y, config, torch.Generator().manual_seed(0), private=private)
            assert torch.equal(torch.get_rng_state(), before)
            finals.append(_flat(model))
    finally:
        torch.set_rng_state(saved)
    assert not torch.equal(finals[0], finals[1])


# ---------------------------------------------------------------- Poisson sampling


@pytest.mark.parametrize(("n", "batch_size", "epochs"), [(5, 2, 2), (7, 3, 1), (4, 8, 2)])
def test_steps_and_rate_admitted_before_training(n, batch_size, epochs):
    """Guards the accounting's premises: the ledger is asked once, before any step, for ⌈n/B⌉ steps per
    epoch at rate min(B/n, 1), and exactly that many batches are drawn."""
    x, y = _data(n, 8)
    private = FakeRound(0.5, 1.0, CountingRandom.seeded(n))
    _train(_tiny(), x, y, TrainConfig(batch_size=batch_size, lr=0.1, local_epochs=epochs), private)
    steps = math.ceil(n / batch_size) * epochs
    assert private.admitted == [(min(batch_size / n, 1.0), steps)]
    assert len(private.rng.batch_sizes) == steps


def test_poisson_batches_vary_and_an_empty_batch_is_a_step():
    """Guards Poisson sampling through a real silo: batch sizes vary, an empty batch (noise only) does not
    break training, and the ledger records ⌈n/B⌉·epochs steps at rate B/n."""
    rng = CountingRandom.seeded(0)
    silo = _silo(_dp_settings(), rng)
    x, y = _data(3, 9)
    model = _tiny()
    before = _flat(model)
    train_local(
        model, x, y, TrainConfig(batch_size=1, lr=0.1, local_epochs=4), torch.Generator(), private=silo
    )
    assert len(rng.batch_sizes) == 3 * 4
    assert 0 in rng.batch_sizes
    assert len(set(rng.batch_sizes)) > 1
    after = _flat(model)
    assert torch.isfinite(after).all()
    assert not torch.equal(after, before)
    (entry,) = silo.ledger.entries
    assert entry["mechanism"] == "dp-sgd"
    assert entry["params"]["steps"] == 12
    assert entry["params"]["sample_rate"] == pytest.approx(1 / 3, abs=1e-6)


# ---------------------------------------------------------------- models, hooks, methods


def test_private_resnet8_has_groupnorm_and_trains_a_dp_step():
    """Guards the DP model variant: BatchNorm mixes a batch's records (no per-sample gradient, no DP
    guarantee), so the private ResNet-8 has GroupNorm instead and takes a DP step; the plain one keeps
    BatchNorm."""
    private_spec = ModelSpec("resnet8", (3, 32, 32), 10, private=True)
    model = private_spec.build(0)
    kinds = {type(m) for m in model.modules()}
    assert nn.GroupNorm in kinds
    assert not any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in kinds)
    assert nn.BatchNorm2d in {type(m) for m in ModelSpec("resnet8", (3, 32, 32), 10).build(0).modules()}

    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen)
    change = _train(model, x, y, TrainConfig(batch_size=2, lr=0.05), FakeRound(0.0, 1.0))
    assert torch.isfinite(change).all()
    assert change.abs().max() > 0


def test_fedprox_pull_is_added_after_privatisation():
    """Guards FedProx under DP: μ(w − w_anchor) uses no record, so it is added to the privatised gradient,
    unclipped. With C = 1e-6 and σ = 0 the records barely move the model, and the step is −lr·μ(w − anchor);
    had the term gone in before clipping (or been overwritten by the optimizer), the step would be ~0."""
    mu, lr = 5.0, 0.1
    method = FedProx(options=FedProxOptions(mu=mu), train=TrainConfig(), model=SPEC, rounds=1)
    model = SPEC.build(0)
    hook = method.before_step(model)  # anchors at the current weights
    offset = 0.01 * torch.randn(_flat(model).shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(_flat(model) + offset, model.parameters())
    seen = []

    def observed_hook() -> None:
        seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        hook()

    x, y = _data(10, 10)
    change = _train(
        model, x, y, TrainConfig(batch_size=10, lr=lr), FakeRound(0.0, 1e-6), before_step=observed_hook
    )
    assert seen  # the hook ran, on a gradient already clipped to C·|batch| / (q·n) = 1e-6
    assert max(seen) <= 1e-6 * (1 + 1e-3)
    torch.testing.assert_close(change, -lr * mu * offset, rtol=0, atol=2e-7)


def test_no_hooks_or_per_sample_state_left_after_private_training():
    """Guards the reused working model: after DP-SGD no Opacus hook, per-sample gradient or captured input
    stays on it, and plain training afterwards is exactly plain training."""
    x, y = _data(8, 11)
    model = SPEC.build(0)
    _train(model, x, y, TrainConfig(batch_size=4, lr=0.1), FakeRound(1.0, 1.0))

    def assert_clean(m: nn.Module) -> None:
        for p in m.parameters():
            assert [getattr(p, a, None) for a in OPACUS_ATTRS] == [None] * len(OPACUS_ATTRS)
        for module in m.modules():
            assert not module._forward_hooks
            assert not module._forward_pre_hooks
            assert not module._backward_hooks
            assert not getattr(module, "_backward_pre_hooks", None)
            assert not getattr(module, "activations", None)  # no records held in the model

    assert_clean(model)
    twin = SPEC.build(0)
    twin.load_state_dict(model.state_dict())
    config = TrainConfig(batch_size=4, lr=0.1)
    train_local(model, x, y, config, torch.Generator().manual_seed(3))
    train_local(twin, x, y, config, torch.Generator().manual_seed(3))
    assert torch.equal(_flat(model), _flat(twin))
    assert_clean(model)


def test_fedavg_local_round_under_dp_reports_the_noisy_count():
    """Guards what a silo releases under DP: the weight `n` is its noisy count (noised once, charged to the
    ledger after the DP-SGD steps), never its true one."""
    settings = _dp_settings()
    method = FedAvg(
        options=FedAvgOptions(), train=TrainConfig(batch_size=8, lr=0.1), model=SPEC, rounds=1, dp=settings
    )
    assert method.model_spec.private
    silo = SiloPrivacy(
        settings,
        method=method,
        ledger=PrivacyLedger(Budget(settings.epsilon, settings.delta)),
        rng=SecureRandom.seeded(1),
    )
    rng = np.random.default_rng(12)
    data = LabeledData(
        rng.random((24, 1, 8, 8), dtype=np.float32),
        rng.integers(0, 10, 24).astype(np.int64),
        tuple("0123456789"),
    )
    state = method.init_state(seed=0)
    ctx = SiloContext(1, "silo-0", 0, private=silo)
    contribution = method.local_round(state, data, ctx)
    reported = float(contribution.values["n"])
    assert reported != 24
    # the per-class counts as the silo releases them (noised once), summed before any clamping: unbiased
    assert reported == max(1, round(float(silo.reported_counts(data.class_counts()).sum())))
    assert [e["mechanism"] for e in silo.ledger.entries] == ["dp-sgd", "gaussian"]  # reused, not re-charged
    assert contribution.values["delta"].abs().max() > 0
