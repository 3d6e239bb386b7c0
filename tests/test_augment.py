import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.methods.augment import random_shift


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=30, deadline=None)
@given(limit=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_every_image_is_its_own_translation_by_at_most_limit_pixels(limit: int, seed: int):
    x = torch.rand(6, 2, 9, 7) + 1  # no zero pixel: a zero in the output can only be the filled border
    moved = random_shift(x, limit, _generator(seed))
    assert moved.shape == x.shape
    for original, image in zip(x, moved, strict=True):
        matches = [
            (dy, dx)
            for dy in range(-limit, limit + 1)
            for dx in range(-limit, limit + 1)
            if torch.equal(image, _translated(original, dy, dx))
        ]
        assert len(matches) == 1


def _translated(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """`image` with content moved down by dy and right by dx, zeros where nothing moved in."""
    _, height, width = image.shape
    out = torch.zeros_like(image)
    out[:, max(dy, 0) : height + min(dy, 0), max(dx, 0) : width + min(dx, 0)] = image[
        :, max(-dy, 0) : height + min(-dy, 0), max(-dx, 0) : width + min(-dx, 0)
    ]
    return out


def test_images_move_independently_and_reproducibly():
    x = torch.rand(64, 1, 8, 8) + 1
    first = random_shift(x, 2, _generator(7))
    assert torch.equal(first, random_shift(x, 2, _generator(7)))
    unmoved = [torch.equal(a, b) for a, b in zip(first, x, strict=True)]
    assert 0 < sum(unmoved) < len(unmoved)  # 1 in 25 images stays put


def test_limit_zero_leaves_the_batch_alone():
    x = torch.rand(3, 1, 5, 5)
    assert random_shift(x, 0, _generator()) is x
