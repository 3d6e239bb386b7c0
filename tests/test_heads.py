"""The head-side primitives the long-tail methods share, pinned against autograd and torch.optim."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.methods.feature_stats import ClassGaussians, class_sums, unpack_symmetric
from fedlt.methods.heads import class_head_gradients, head_gradient, mean_over_holders, retrain_head


def _head(classes=4, dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(classes, dim, generator=g), torch.randn(classes, generator=g)


def _autograd_head_gradient(weight, bias, z, y):
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    F.cross_entropy(z @ w.T + b, y).backward()
    return torch.cat([w.grad, b.grad[:, None]], dim=1)


def test_closed_form_head_gradient_equals_autograd():
    weight, bias = _head()
    z = torch.randn(13, 6)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 1, 2, 3])
    assert torch.allclose(
        head_gradient(weight, bias, z, y), _autograd_head_gradient(weight, bias, z, y), atol=1e-6
    )


def test_class_gradients_are_per_class_means_and_zero_for_missing_classes():
    weight, bias = _head()
    z = torch.randn(9, 6)
    y = torch.tensor([0, 0, 0, 2, 2, 0, 2, 0, 0])  # classes 1 and 3 missing
    present, grads = class_head_gradients(weight, bias, z, y)
    assert present.tolist() == [1.0, 0.0, 1.0, 0.0]
    for c in (0, 2):
        expected = _autograd_head_gradient(weight, bias, z[y == c], y[y == c]).double()
        assert torch.allclose(grads[c], expected, atol=1e-6)
    assert grads[1].abs().max() == 0
    assert grads[3].abs().max() == 0


def test_mean_over_holders_divides_by_silos_holding_each_class():
    """Three silos; class 0 held by all, class 1 by one, class 2 by none: each is a mean over its holders."""
    weight, bias = _head(classes=3, dim=5)
    silos = [
        (torch.randn(6, 5), torch.tensor([0, 0, 1, 1, 0, 1])),
        (torch.randn(4, 5), torch.tensor([0, 0, 0, 0])),
        (torch.randn(3, 5), torch.tensor([0, 0, 0])),
    ]
    parts = [class_head_gradients(weight, bias, z, y) for z, y in silos]
    summed_present = sum(p for p, _ in parts)
    summed_grads = sum(g for _, g in parts)
    held, means = mean_over_holders(summed_grads, summed_present)
    assert held.tolist() == [True, True, False]
    assert torch.allclose(means[0], sum(g[0] for _, g in parts) / 3)
    assert torch.allclose(means[1], parts[0][1][1])  # only silo 0 holds class 1: its own mean
    assert means[2].abs().max() == 0


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 1e-3)])
def test_retrain_head_steps_exactly_as_torch_sgd(momentum, weight_decay):
    weight, bias = _head()
    z, y = torch.randn(20, 6), torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(1))
    new_w, new_b = retrain_head(
        z,
        y,
        weight,
        bias,
        epochs=3,
        lr=0.1,
        batch_size=8,
        momentum=momentum,
        weight_decay=weight_decay,
        generator=torch.Generator().manual_seed(7),
    )
    head = torch.nn.Linear(6, 4)
    head.weight.data, head.bias.data = weight.clone(), bias.clone()
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    order_source = torch.Generator().manual_seed(7)
    for _ in range(3):
        order = torch.randperm(20, generator=order_source)
        for start in range(0, 20, 8):
            idx = order[start : start + 8]
            optimizer.zero_grad()
            F.cross_entropy(head(z[idx]), y[idx]).backward()
            optimizer.step()
    assert torch.allclose(new_w, head.weight.data, atol=1e-5)
    assert torch.allclose(new_b, head.bias.data, atol=1e-5)
    assert not torch.equal(new_w, weight)  # the inputs are left alone, the result moved


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=2, max_size=5), seed=st.integers(0, 2**16))
def test_pooled_statistics_equal_those_of_the_pooled_features(sizes, seed):
    """CCVR's pooled mean and covariance from per-silo sums = mean and unbiased covariance of all features."""
    g = torch.Generator().manual_seed(seed)
    classes, dim = 3, 4
    silos = [
        (torch.randn(n, dim, generator=g) * 3 + 1, torch.randint(0, classes, (n,), generator=g))
        for n in sizes
    ]
    sums = [class_sums(z, y, classes) for z, y in silos]
    pooled = ClassGaussians.from_sums(
        *(sum(s[k] for s in sums) for k in ("feature_sum", "outer_sum", "count"))
    )
    z_all = torch.cat([z for z, _ in silos]).double()
    y_all = torch.cat([y for _, y in silos])
    for c in range(classes):
        zc = z_all[y_all == c]
        assert pooled.counts[c] == len(zc)
        if len(zc) == 0:
            assert not pooled.present[c]
            continue
        assert torch.allclose(pooled.means[c], zc.mean(0), atol=1e-9)
        expected = torch.cov(zc.T) if len(zc) > 1 else torch.zeros(dim, dim, dtype=torch.float64)
        assert torch.allclose(pooled.covariances[c], expected, atol=1e-9)


def test_upper_triangle_round_trips_a_symmetric_matrix():
    a = torch.randn(5, 5, dtype=torch.float64)
    sym = a + a.T
    rows, cols = torch.triu_indices(5, 5)
    assert torch.equal(unpack_symmetric(sym[rows, cols], 5), sym)


def test_virtual_features_follow_the_class_gaussian_and_skip_absent_classes():
    z = torch.randn(400, 3, generator=torch.Generator().manual_seed(0)) @ torch.tensor(
        [[2.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 0.1]]
    )
    y = torch.zeros(400, dtype=torch.int64)
    gaussians = ClassGaussians.from_sums(**class_sums(z + 5, y, 2))
    virtual, labels = gaussians.sample(20_000, torch.Generator().manual_seed(1))
    assert labels.unique().tolist() == [0]  # class 1 has no statistics and gets no virtual features
    assert torch.allclose(virtual.double().mean(0), gaussians.means[0], atol=0.05)
    assert torch.allclose(torch.cov(virtual.double().T), gaussians.covariances[0], atol=0.08)
