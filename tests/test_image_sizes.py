"""Images of any size and mode made into a plan's image_shape: known answers on synthetic images for every
resize mode, the same pixels every time, and one clear DataError line per mistake."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fedlt.config import parse_section
from fedlt.data.arrays import LabeledData
from fedlt.data.files import load_image_folder, open_source
from fedlt.data.images import RESIZERS, ImageFiles, ImageSettings, read_image_folder
from fedlt.errors import DataError

RNG = np.random.default_rng(0)
MODES = ("stretch", "crop", "pad")


def _save(path: Path, pixels: np.ndarray, mode: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(pixels)
    (image.convert(mode) if mode else image).save(path)
    return path


def _u8(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, size=shape, dtype=np.uint8)


def _one(tmp_path: Path, pixels: np.ndarray, mode: str | None = None) -> ImageFiles:
    _save(tmp_path / "only" / "image.png", pixels, mode)
    return read_image_folder(tmp_path)


def _halves(height: int, width: int) -> np.ndarray:
    """White on the left half, black on the right."""
    pixels = np.zeros((height, width), np.uint8)
    pixels[:, : width // 2] = 255
    return pixels


def _one_line_naming(path: Path, match: str) -> pytest.RaisesExc:
    return pytest.raises(DataError, match=rf"^[^\n]*{re.escape(path.name)}[^\n]*{match}[^\n]*$")


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    """PNG and JPEG of four sizes and five modes (gray, RGB, RGBA, palette, bilevel) in two classes."""
    _save(tmp_path / "cat" / "gray.png", _u8(10, 20))
    _save(tmp_path / "cat" / "colour.jpg", _u8(17, 13, 3))
    _save(tmp_path / "dog" / "alpha.png", _u8(8, 8, 4))
    _save(tmp_path / "dog" / "palette.png", _u8(5, 30, 3), mode="P")
    _save(tmp_path / "dog" / "bilevel.png", _u8(40, 9), mode="1")
    return tmp_path


# --- the plan's shape from any folder ---------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("resize", MODES)
def test_a_folder_of_mixed_sizes_and_modes_takes_the_plans_shape(mixed_folder, resize, channels):
    files = open_source(mixed_folder)
    assert isinstance(files, ImageFiles)
    assert (len(files), files.classes, files.source) == (5, ("cat", "dog"), str(mixed_folder))
    data = files.prepared((channels, 16, 16), ImageSettings(resize=resize))
    assert isinstance(data, LabeledData)
    assert data.x.shape == (5, channels, 16, 16)
    assert data.x.dtype == np.float32
    assert data.x.min() >= 0.0
    assert data.x.max() <= 1.0
    assert data.y.tolist() == [0, 0, 1, 1, 1]  # files sorted within each class folder
    assert data.classes == ("cat", "dog")


def test_gray_images_become_three_equal_planes(tmp_path):
    x = _one(tmp_path, _u8(12, 7)).prepared((3, 16, 16), ImageSettings(resize="stretch")).x[0]
    assert np.array_equal(x[0], x[1])
    assert np.array_equal(x[0], x[2])


def test_colour_keeps_its_channels(tmp_path):
    red_left = np.zeros((16, 32, 3), np.uint8)
    red_left[:, :16, 0] = 255
    x = _one(tmp_path, red_left).prepared((3, 16, 16), ImageSettings(resize="crop")).x[0]
    assert x[0, :, :8].min() == 1.0
    assert x[0, :, 8:].max() == 0.0
    assert x[1:].max() == 0.0


# --- known answers ---------------------------------------------------------------------------


def test_crop_keeps_the_centre_of_a_wide_image(tmp_path):
    """32x16 into 16x16 at scale 1: columns 8..24 remain, the left half of them white."""
    x = _one(tmp_path, _halves(16, 32)).prepared((1, 16, 16), ImageSettings(resize="crop")).x[0, 0]
    expected = np.zeros((16, 16), np.float32)
    expected[:, :8] = 1.0
    np.testing.assert_array_equal(x, expected)


def test_pad_centres_the_image_between_zero_borders(tmp_path):
    """32x16 into 16x16: scaled to 16x8, rows 4..12; the halves stay halves away from the seam."""
    x = _one(tmp_path, _halves(16, 32)).prepared((1, 16, 16), ImageSettings(resize="pad")).x[0, 0]
    assert x[:4].max() == 0.0
    assert x[12:].max() == 0.0
    assert x[4:12, :7].min() == 1.0
    assert x[4:12, 9:].max() == 0.0


def test_stretch_squeezes_the_width_and_keeps_the_halves(tmp_path):
    x = _one(tmp_path, _halves(8, 40)).prepared((1, 16, 16), ImageSettings(resize="stretch")).x[0, 0]
    assert x[:, :7].min() == 1.0
    assert x[:, 9:].max() == 0.0


@pytest.mark.parametrize("resize", ["stretch", "crop"])
def test_a_solid_image_stays_solid(tmp_path, resize):
    solid = np.full((9, 23), 77, np.uint8)
    x = _one(tmp_path, solid).prepared((1, 16, 16), ImageSettings(resize=resize)).x
    assert np.all(x == np.float32(77) / np.float32(255))


def test_pad_of_a_solid_image_is_solid_between_zero_borders(tmp_path):
    """23x9 into 16x16: scaled by 16/23 to 16x6, pasted at rows 5..11."""
    x = _one(tmp_path, np.full((9, 23), 77, np.uint8)).prepared((1, 16, 16), ImageSettings(resize="pad")).x
    assert np.all(x[0, 0, 5:11] == np.float32(77) / np.float32(255))
    assert x[0, 0, :5].max() == 0.0
    assert x[0, 0, 11:].max() == 0.0


def test_pad_keeps_a_line_thinner_than_its_scale(tmp_path):
    """A 64x1 line in 16x16 scales to 16x0.25: it keeps one row, row (16 - 1) // 2 (ImageOps.pad drops it)."""
    x = _one(tmp_path, np.full((1, 64), 255, np.uint8)).prepared((1, 16, 16), ImageSettings(resize="pad")).x
    assert x[0, 0, 7].min() == 1.0
    assert x.sum() == 16


@pytest.mark.parametrize("resize", ["none", *MODES])
def test_images_of_the_plans_size_are_taken_as_they_are(tmp_path, resize):
    """The oracle is load_image_folder, which never resizes: every mode leaves such images alone."""
    _save(tmp_path / "a" / "1.png", _u8(12, 10))
    _save(tmp_path / "b" / "2.png", _u8(12, 10))
    expected = load_image_folder(tmp_path)
    data = read_image_folder(tmp_path).prepared((1, 12, 10), ImageSettings(resize=resize))
    np.testing.assert_array_equal(data.x, expected.x)
    np.testing.assert_array_equal(data.y, expected.y)


def test_prepared_twice_and_from_a_copy_gives_the_same_bytes(mixed_folder, tmp_path_factory):
    copy = tmp_path_factory.mktemp("copy")
    for file in mixed_folder.rglob("*.*"):
        (copy / file.relative_to(mixed_folder)).parent.mkdir(exist_ok=True)
        (copy / file.relative_to(mixed_folder)).write_bytes(file.read_bytes())
    plan = ((3, 16, 16), ImageSettings(resize="crop"))
    first = read_image_folder(mixed_folder).prepared(*plan).x
    assert first.tobytes() == read_image_folder(mixed_folder).prepared(*plan).x.tobytes()
    assert first.tobytes() == read_image_folder(copy).prepared(*plan).x.tobytes()


@settings(max_examples=100, deadline=None)
@given(
    source=st.tuples(st.integers(1, 48), st.integers(1, 48)),
    target=st.tuples(st.integers(1, 24), st.integers(1, 24)),
    channels=st.sampled_from([1, 3]),
    resize=st.sampled_from(MODES),
    mode=st.sampled_from(["L", "RGB", "P"]),
)
def test_any_size_becomes_exactly_the_plans_shape(tmp_path_factory, source, target, channels, resize, mode):
    root = tmp_path_factory.mktemp("any")
    _save(root / "c" / "i.png", _u8(source[1], source[0], 3), mode)
    x = read_image_folder(root).prepared((channels, *target), ImageSettings(resize=resize)).x
    assert x.shape == (1, channels, *target)
    assert x.min() >= 0.0
    assert x.max() <= 1.0


@settings(max_examples=100, deadline=None)
@given(
    source=st.tuples(st.integers(1, 64), st.integers(1, 64)),
    target=st.tuples(st.integers(1, 24), st.integers(1, 24)),
    resize=st.sampled_from(MODES),
)
def test_float_images_resize_to_the_size_within_zero_and_one(source, target, resize):
    """The DICOM path resizes "F" images; values stay within [0, 1] up to rounding, which is clipped."""
    values = np.random.default_rng(sum(source)).random((source[1], source[0]), dtype=np.float32)
    resized = RESIZERS[resize](Image.fromarray(values), target)
    pixels = np.asarray(resized)
    assert resized.size == target
    assert pixels.min() >= -1e-6
    assert pixels.max() <= 1.0 + 1e-6


# --- one line per mistake -------------------------------------------------------------------


def test_resize_none_refuses_another_size_naming_file_and_sizes(tmp_path):
    _save(tmp_path / "a" / "fits.png", _u8(16, 16))
    odd = _save(tmp_path / "b" / "odd.jpg", _u8(17, 13))
    files = read_image_folder(tmp_path)
    with _one_line_naming(odd, "13x17 .*asks for 16x16.*'stretch', 'crop' or 'pad'"):
        files.prepared((1, 16, 16), ImageSettings())


def test_multi_frame_images_are_refused_when_opened(tmp_path):
    stack = tmp_path / "a" / "stack.tif"
    stack.parent.mkdir()
    frames = [Image.fromarray(_u8(4, 4)) for _ in range(3)]
    frames[0].save(stack, save_all=True, append_images=frames[1:])
    with _one_line_naming(stack, "has 3 frames"):
        read_image_folder(tmp_path)


def test_a_corrupt_image_is_named_when_prepared(tmp_path):
    _save(tmp_path / "a" / "good.png", _u8(16, 16))
    bad = _save(tmp_path / "a" / "cut.png", _u8(16, 16))
    bad.write_bytes(bad.read_bytes()[:100])  # the header survives, the pixels do not
    files = read_image_folder(tmp_path)
    with _one_line_naming(bad, "cannot read image"):
        files.prepared((1, 8, 8), ImageSettings(resize="stretch"))


@pytest.mark.parametrize(
    ("shape", "images", "match"),
    [
        ((2, 16, 16), ImageSettings(resize="crop"), r"1 \(grayscale\) or 3 \(RGB\) channels, got 2"),
        ((1, 0, 16), ImageSettings(resize="crop"), r"expected \[channels, height, width\]"),
        ((1, 16, 16), ImageSettings(window=(40.0,)), r"window: expected \[center, width\]"),
        ((1, 16, 16), ImageSettings(window=(40.0, 0.0)), "width > 0"),
        ((1, 16, 16), ImageSettings(window=(float("nan"), 400.0)), "window"),
    ],
)
def test_a_plan_images_cannot_take_is_refused(tmp_path, shape, images, match):
    files = _one(tmp_path, _u8(16, 16))
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path))}: [^\n]*{match}"):
        files.prepared(shape, images)


def test_image_settings_parse_as_a_plan_section():
    problems: list[str] = []
    parsed = parse_section(
        ImageSettings, {"resize": "crop", "window": [-600.0, 1500.0]}, "data.images", problems
    )
    assert (parsed, problems) == (ImageSettings(resize="crop", window=(-600.0, 1500.0)), [])
    assert parsed.problems((1, 28, 28)) == []
    assert ImageSettings(window=(40.0,)).problems((4, 28, 28)) == [
        "data.images.window: expected [center, width] with a width > 0, got [40.0]",
        "model.image_shape: images have 1 (grayscale) or 3 (RGB) channels, got 4",
    ]
    parse_section(ImageSettings, {"resize": "zoom", "windw": []}, "data.images", problems)
    assert problems == [
        "data.images.windw: unknown setting (did you mean 'window'?)",
        "data.images.resize: must be one of 'none', 'stretch', 'crop', 'pad', got 'zoom'",
    ]


def test_an_image_folder_takes_no_options(tmp_path):
    _save(tmp_path / "a" / "1.png", _u8(4, 4))
    with pytest.raises(DataError, match="format 'folder' takes options none, got color"):
        open_source(tmp_path, color="rgb")


def test_arrays_are_opened_as_loaded(tmp_path):
    np.savez(tmp_path / "d.npz", x=_u8(2, 4, 4), y=np.array([0, 1]))
    opened = open_source(tmp_path / "d.npz")
    assert isinstance(opened, LabeledData)
    assert opened.input_shape == (1, 4, 4)
