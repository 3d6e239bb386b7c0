import pytest
import torch

from fedlt.errors import ConfigError
from fedlt.models import build_model


@pytest.mark.parametrize(
    ("name", "shape", "params", "feature_dim"),
    [
        ("cnn", (1, 28, 28), 1_663_370, 512),  # McMahan et al. 2017 report 1,663,370
        ("cnn-small", (1, 8, 8), None, 128),
        ("resnet8", (3, 32, 32), None, 256),
    ],
)
def test_split_model_contract(name, shape, params, feature_dim):
    model = build_model(name, input_shape=shape, num_classes=10, seed=0)
    x = torch.rand(4, *shape)
    z = model.encoder(x)
    assert z.shape == (4, feature_dim)
    assert (z >= 0).all(), "features are post-ReLU"
    assert torch.equal(model.classifier(z), model(x))
    if params is not None:
        assert sum(p.numel() for p in model.parameters()) == params


def test_resnet8_size_matches_creff():
    model = build_model("resnet8", input_shape=(3, 32, 32), num_classes=10, seed=0)
    total = sum(p.numel() for p in model.parameters())
    assert 1.22e6 < total < 1.24e6
    convs = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert convs == 1_222_336  # 3 stages x 1 BasicBlock, 64/128/256, 1x1 shortcuts


def test_resnet8_also_takes_28x28():
    model = build_model("resnet8", input_shape=(1, 28, 28), num_classes=10, seed=0)
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)


def test_seed_fixes_weights_without_touching_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("cnn-small", input_shape=(1, 8, 8), num_classes=10, seed=7)
    after = torch.rand(1)
    b = build_model("cnn-small", input_shape=(1, 8, 8), num_classes=10, seed=7)
    c = build_model("cnn-small", input_shape=(1, 8, 8), num_classes=10, seed=8)
    assert torch.equal(before, after)
    assert all(
        torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_wrong_input_size_is_a_config_error():
    with pytest.raises(ConfigError, match="cnn takes 28x28 images, got 8x8"):
        build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    with pytest.raises(ConfigError, match="allowed: cnn, cnn-small, resnet8"):
        build_model("vgg", input_shape=(1, 8, 8), num_classes=10, seed=0)
