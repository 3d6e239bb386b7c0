"""SFD's mathematics: the MeanCov aligner, the random-feature MMD, statistics as sums, A-CE and A-SCL."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.data.arrays import LabeledData
from fedlt.errors import ConfigError
from fedlt.methods import ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.abbl import (
    adaptive_contrastive,
    adaptive_cross_entropy,
    contrastive_weight,
    prior_of_counts,
)
from fedlt.methods.feature_stats import ClassGaussians
from fedlt.methods.heads import extract_features
from fedlt.methods.rff import RandomFourierFeatures
from fedlt.methods.safs import MeanCovAligner, SynthesisSettings, synthesize_class, synthetic_counts
from fedlt.methods.sfd import SFD, SFDOptions

SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)
TRAIN = TrainConfig(local_epochs=1, batch_size=8, lr=0.1)


def _sfd(**options):
    defaults = {
        "rff_features": 64,
        "synthesis_steps": 3,
        "finetune_epochs": 2,
        "synthetic_fewest": 150,
        "synthetic_most": 200,
    }
    return SFD(options=SFDOptions(**{**defaults, **options}), train=TRAIN, model=SPEC, rounds=1)


def test_meancov_aligner_output_has_exactly_the_target_mean_and_covariance():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    target_cov = a @ a.T + 0.1 * torch.eye(6, dtype=torch.float64)
    target_mean = torch.randn(6, generator=g, dtype=torch.float64) * 3
    bank = torch.randn(40, 6, generator=g, dtype=torch.float64) * 5 + 2
    out = MeanCovAligner(target_mean, target_cov, target_eps=0.0, input_eps=0.0)(bank)
    assert torch.allclose(out.mean(0), target_mean, atol=1e-10)
    assert torch.allclose(torch.cov(out.T), target_cov, atol=1e-10)


def _exact_mmd2(u, v, gamma):
    k = lambda a, b: torch.exp(-gamma * torch.cdist(a, b) ** 2)  # noqa: E731
    return k(u, u).mean() + k(v, v).mean() - 2 * k(u, v).mean()


@pytest.mark.parametrize("orthogonal", [True, False])
def test_random_feature_mmd_approximates_the_exact_rbf_mmd_within_0_01(orthogonal):
    """With D = 3000 (SFD's default) and γ = 0.01, ‖mean φ(U) − mean φ(V)‖² is within 0.01 of Eq. 2's MMD²."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(300, 8, generator=g, dtype=torch.float64) * 3
    for shift in (0.0, 2.0, 5.0):
        v = torch.randn(300, 8, generator=g, dtype=torch.float64) * 3 + shift
        rff = RandomFourierFeatures(8, 3000, 0.01, orthogonal=orthogonal, seed=int(shift))
        approx = ((rff(u).mean(0) - rff(v).mean(0)) ** 2).sum()
        assert abs(approx - _exact_mmd2(u, v, 0.01)) < 0.01


def test_random_features_are_the_same_for_the_same_seed_and_differ_across_seeds():
    z = torch.randn(5, 7)
    a = RandomFourierFeatures(7, 20, 0.01, orthogonal=True, seed=3)
    assert torch.equal(a(z), RandomFourierFeatures(7, 20, 0.01, orthogonal=True, seed=3)(z))
    assert not torch.equal(a(z), RandomFourierFeatures(7, 20, 0.01, orthogonal=True, seed=4)(z))


def _silo(labels, seed):
    rng = np.random.default_rng(seed)
    x = rng.random((len(labels), 1, 8, 8), dtype=np.float32)
    return LabeledData(x, np.asarray(labels, dtype=np.int64), tuple("abcd"))


def test_statistics_from_sums_equal_those_of_the_pooled_features():
    method = _sfd()
    state = method.init_state(seed=0)
    state = type(state)(1, state.model, {"trained": torch.tensor(1)})  # training done: the closing round
    silos = [_silo([0, 0, 1, 1, 1, 0], 0), _silo([1, 2, 2, 2, 2], 1), _silo([0, 2, 0, 0], 2)]
    schema = method.schema(state)
    contributions = [
        method.local_round(state, d, SiloContext(2, f"silo-{k}", 5)) for k, d in enumerate(silos)
    ]
    sums = PlaintextSum().aggregate(schema, contributions)
    pooled = ClassGaussians.from_sums(sums["feature_sum"], sums["outer_sum"], sums["count"], unbiased=False)
    model = method.load(state.model)
    z = torch.cat([extract_features(model, torch.from_numpy(d.x)) for d in silos]).double()
    y = torch.cat([torch.from_numpy(d.y) for d in silos])
    phi = method.random_features(5)(z)
    for c in range(3):
        zc = z[y == c]
        assert torch.allclose(pooled.means[c], zc.mean(0), atol=1e-6)
        assert torch.allclose(pooled.covariances[c], torch.cov(zc.T, correction=0), atol=1e-6)
        assert torch.allclose(sums["rff_sum"][c] / len(zc), phi[y == c].mean(0), atol=1e-6)
    assert sums["count"].tolist() == [6, 4, 5, 0]


def test_adaptive_ce_gives_missing_classes_a_repulsive_gradient_only_when_beta_pi_is_positive():
    y = torch.tensor([0, 0, 1, 1, 1])  # classes 2 and 3 missing on this silo
    logits = torch.randn(5, 4, requires_grad=True)
    for beta_pi, expect_gradient in ((1.0, True), (0.5, True), (0.0, False)):
        logits.grad = None
        prior = prior_of_counts(torch.bincount(y, minlength=4).float(), beta_pi)
        adaptive_cross_entropy(logits, y, prior, gamma=0.1).mean().backward()
        missing = logits.grad[:, 2:]
        assert bool((missing > 0).all()) == expect_gradient
        assert bool((missing == 0).all()) == (not expect_gradient)
    assert prior_of_counts(torch.bincount(y, minlength=4).float(), 0.5).tolist() == [2.0, 3.0, 1.0, 1.0]


def test_adaptive_contrastive_loss_is_eq_7_per_sample():
    g = torch.Generator().manual_seed(2)
    projected = torch.randn(6, 5, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 2, 1, 0])
    prior = torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64)
    h = F.normalize(projected, dim=1)
    total = 0.0
    for i in range(6):
        denominator = sum(
            torch.exp(h[i] @ h[b] / 0.07 + (0 if y[b] == y[i] else torch.log(prior[y[b]])))
            for b in range(6)
            if b != i
        )
        positives = [a for a in range(6) if y[a] == y[i]]
        total += -sum(h[i] @ h[a] / 0.07 - torch.log(denominator) for a in positives) / len(positives)
    expected = total / 6
    assert adaptive_contrastive(projected, y, prior, 0.07).item() == pytest.approx(expected.item(), rel=1e-9)


def test_contrastive_weight_is_cosine_annealed_to_zero():
    assert contrastive_weight(0.1, 0, 10) == pytest.approx(0.1)
    assert contrastive_weight(0.1, 5, 10) == pytest.approx(0.05)
    assert contrastive_weight(0.1, 10, 10) == pytest.approx(0.0, abs=1e-12)


def test_synthetic_counts_run_linearly_by_rank_from_rarest_to_most_frequent():
    sizes = torch.tensor([400.0, 4.0, 50.0, 50.0, 11.0])
    assert synthetic_counts(sizes, 2000, 600).tolist() == [600, 2000, 1067, 1067, 1533]


def test_a_class_with_fewer_records_than_dimensions_synthesises_from_fixed_point_sums():
    """The secure layers round Σzzᵀ to 2⁻¹⁶: for a class of two records the scatter left after subtracting
    n·μμᵀ has negative eigenvalues far larger than the aligner's 1e-5 ridge, and its Cholesky failed."""
    method = _sfd()
    state = method.init_state(seed=0)
    state = type(state)(1, state.model, {"trained": torch.tensor(1)})
    silos = [_silo([0, 0, 1, 1, 1, 0, 2, 2, 2], 0), _silo([3, 3, 1, 2], 1)]
    schema = method.schema(state)
    contributions = [
        method.local_round(state, d, SiloContext(2, f"silo-{k}", 5)) for k, d in enumerate(silos)
    ]
    sums = PlaintextSum().aggregate(schema, contributions)
    grid = {f.name: 2.0**f.frac_bits for f in schema.fields}
    rounded = {name: torch.round(value * grid[name]) / grid[name] for name, value in sums.items()}
    features, labels = method.synthetic_features(rounded, ServerContext(2, 5))
    assert torch.isfinite(features).all()
    assert sorted(set(labels.tolist())) == [0, 1, 2, 3]
    assert torch.linalg.eigvalsh(method.pooled(rounded, unbiased=False).covariances).min() > -1e-9


def test_synthesis_keeps_the_class_statistics_and_lowers_the_mmd():
    g = torch.Generator().manual_seed(3)
    real = torch.relu(torch.randn(500, 6, generator=g) * 2 + 1).double()
    mean, cov = real.mean(0), torch.cov(real.T, correction=0)
    rff = RandomFourierFeatures(6, 400, 0.05, orthogonal=True, seed=0)
    target = rff(real).mean(0)
    untrained = synthesize_class(
        300, mean, cov, target, rff, SynthesisSettings(steps=0), torch.Generator().manual_seed(4)
    )
    trained = synthesize_class(
        300, mean, cov, target, rff, SynthesisSettings(steps=60), torch.Generator().manual_seed(4)
    )
    for z in (untrained, trained):
        assert torch.allclose(z.double().mean(0), mean, atol=1e-3)
        assert torch.allclose(
            torch.cov(z.double().T), cov + 1e-5 * torch.eye(6, dtype=torch.float64), atol=1e-2
        )
    gap = lambda z: (target - rff(z.double()).mean(0)).abs().sum()  # noqa: E731
    assert gap(trained) < gap(untrained)
    assert (trained < 0).float().mean() < (untrained < 0).float().mean()  # ARR pushes towards post-ReLU range


def test_a_closing_round_fits_the_evaluated_head_from_synthetic_features():
    method = _sfd()
    state = method.init_state(seed=0)
    silos = [_silo([0, 0, 1, 1, 1, 0, 2, 2], 0), _silo([1, 2, 2, 3, 3, 3], 1)]
    for r in (1, 2):
        schema = method.schema(state)
        contributions = [
            method.local_round(state, d, SiloContext(r, f"silo-{k}", 0)) for k, d in enumerate(silos)
        ]
        state = method.server_step(
            state, PlaintextSum().aggregate(schema, contributions), ServerContext(r, 0)
        )
    assert method.remaining_rounds(state) == 0
    assert "projector.0.weight" in state.model
    evaluated = method.eval_model(state)
    assert torch.equal(evaluated.classifier.weight, state.extra["head.weight"])


def test_settings_the_aligner_cannot_use_are_refused():
    with pytest.raises(ConfigError, match="synthetic_fewest"):
        _sfd(synthetic_fewest=100)  # cnn-small features have 128 dimensions
    with pytest.raises(ConfigError, match="rff_features"):
        _sfd(rff_features=65)
