"""Loaders for on-disk data: round trips with known pixels, and one clear DataError per mistake."""

from __future__ import annotations

import gzip
import os
import pickle
import re
import shlex
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fedlt.data.files import (
    CIFAR10_CLASSES,
    load_cifar10_batches,
    load_dataset,
    load_idx,
    load_image_folder,
    load_npz,
)
from fedlt.data.images import read_image_folder
from fedlt.errors import DataError

RNG = np.random.default_rng(0)


def _u8(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, size=shape, dtype=np.uint8)


def _as_u8(x: np.ndarray) -> np.ndarray:
    """Undo the 1/255 scaling; exact because every uint8 value survives the round trip."""
    return np.rint(x * 255).astype(np.uint8)


def _raises_naming(path: Path, match: str = "") -> pytest.RaisesExc:
    """A DataError whose message names the offending file (and says `match`)."""
    return pytest.raises(DataError, match=rf"{re.escape(path.name)}(.|\n)*{match}")


# --- npz ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "to_disk"),
    [
        ("NHW", lambda a: a[:, 0]),
        ("NHWC", lambda a: a.transpose(0, 2, 3, 1)),
        ("NCHW", lambda a: a),
    ],
)
def test_npz_round_trip_uint8_layouts(tmp_path, layout, to_disk):
    channels = 1 if layout == "NHW" else 3
    x = _u8(5, channels, 4, 6)
    y = np.array([0, 2, 1, 2, 0], dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x=to_disk(x), y=y)
    data = load_npz(tmp_path / "d.npz")
    assert data.x.shape == (5, channels, 4, 6)
    assert data.x.dtype == np.float32
    np.testing.assert_array_equal(_as_u8(data.x), x)
    np.testing.assert_array_equal(data.y, y)
    assert data.classes == ("0", "1", "2")
    assert data.source == str(tmp_path / "d.npz")


def test_npz_extremes_scale_exactly(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.array([[[0, 255]]], dtype=np.uint8), y=np.array([0]))
    assert load_npz(tmp_path / "d.npz").x.ravel().tolist() == [0.0, 1.0]


def test_npz_float_and_class_names(tmp_path):
    x = np.linspace(0, 1, 2 * 3 * 3).reshape(2, 3, 3)
    np.savez(tmp_path / "d.npz", x=x, y=np.array([1, 0], dtype=np.int16), classes=["cat", "dog"])
    data = load_npz(tmp_path / "d.npz")
    np.testing.assert_array_equal(data.x[:, 0], x.astype(np.float32))
    assert data.classes == ("cat", "dog")
    assert load_npz(tmp_path / "d.npz", classes=["a", "b", "c"]).classes == ("a", "b", "c")


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"x": np.zeros((2, 3, 3), np.uint8)}, "missing array.*y"),
        ({"x": np.zeros((3, 3, 3), np.uint8), "y": np.zeros(2, np.int64)}, "3 images but 2 labels"),
        ({"x": np.full((1, 2, 2), 1.5), "y": np.zeros(1, np.int64)}, r"min 1\.5, max 1\.5"),
        ({"x": np.zeros((1, 2, 2), np.int16), "y": np.zeros(1, np.int64)}, "dtype int16"),
        ({"x": np.zeros((1, 2, 2), np.uint8), "y": np.zeros(1, np.float64)}, "integer"),
        ({"x": np.zeros((1, 2, 5, 5), np.uint8), "y": np.zeros(1, np.int64)}, "shape"),
    ],
)
def test_npz_bad_arrays(tmp_path, arrays, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with _raises_naming(path, match):
        load_npz(path)


def test_npz_labels_out_of_range_of_given_classes(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((2, 2, 2), np.uint8), y=np.array([0, 3]))
    with _raises_naming(path, r"out of range \[0, 2\): \[3\]"):
        load_npz(path, classes=["a", "b"])


def test_npz_empty_class_list(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((1, 2, 2), np.uint8), y=np.array([0]))
    with _raises_naming(path, "class list is empty"):
        load_npz(path, classes=[])


def test_npz_refuses_pickled_objects_and_non_archives(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with _raises_naming(path, "pickle"):
        load_npz(path)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip archive")
    with _raises_naming(junk):
        load_npz(junk)


def test_missing_file(tmp_path):
    with _raises_naming(tmp_path / "nope.npz", "no such file or directory"):
        load_npz(tmp_path / "nope.npz")
    with _raises_naming(tmp_path / "nodir", "no such file or directory"):
        load_image_folder(tmp_path / "nodir")


# --- image folder ------------------------------------------------------------------------------


def _save(path: Path, pixels: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def test_image_folder_gray_round_trip(tmp_path):
    a, b, c = _u8(4, 5), _u8(4, 5), _u8(4, 5)
    _save(tmp_path / "b_class" / "1.png", c)
    _save(tmp_path / "a_class" / "2.PNG", b)
    _save(tmp_path / "a_class" / "1.bmp", a)
    (tmp_path / "a_class" / "notes.txt").write_text("ignored")
    (tmp_path / "a_class" / "._1.png").write_bytes(b"macOS metadata, ignored")
    (tmp_path / "empty_class").mkdir()
    (tmp_path / ".hidden").mkdir()
    data = load_image_folder(tmp_path)
    assert data.classes == ("a_class", "b_class", "empty_class")
    assert data.x.shape == (3, 1, 4, 5)
    np.testing.assert_array_equal(_as_u8(data.x[:, 0]), np.stack([a, b, c]))
    np.testing.assert_array_equal(data.y, [0, 0, 1])
    assert data.class_counts().tolist() == [2, 1, 0]


def test_image_folder_infers_rgb_from_any_colour_image(tmp_path):
    rgb = _u8(4, 5, 3)
    _save(tmp_path / "a" / "gray.png", _u8(4, 5))
    _save(tmp_path / "b" / "colour.png", rgb)
    data = load_image_folder(tmp_path)
    assert data.x.shape == (2, 3, 4, 5)
    np.testing.assert_array_equal(_as_u8(data.x[1]), rgb.transpose(2, 0, 1))
    # The gray image becomes three equal planes.
    assert np.array_equal(data.x[0, 0], data.x[0, 1])
    assert np.array_equal(data.x[0, 0], data.x[0, 2])
    assert load_image_folder(tmp_path, color="gray").x.shape == (2, 1, 4, 5)


def test_image_folder_forced_rgb_from_gray(tmp_path):
    _save(tmp_path / "a" / "gray.png", _u8(4, 5))
    assert load_image_folder(tmp_path).x.shape == (1, 1, 4, 5)
    assert load_image_folder(tmp_path, color="rgb").x.shape == (1, 3, 4, 5)


def test_image_folder_size_mismatch_names_that_image(tmp_path):
    _save(tmp_path / "a" / "1.png", _u8(4, 5))
    odd = _save(tmp_path / "b" / "odd.png", _u8(6, 5))
    with _raises_naming(odd, "5x6 but a/1.png is 5x4"):
        load_image_folder(tmp_path)


@pytest.mark.parametrize("content", [b"this is not an image", b"truncated"])
def test_image_folder_corrupt_image(tmp_path, content):
    _save(tmp_path / "a" / "1.png", _u8(16, 16))
    bad = tmp_path / "a" / "2.png"
    if content == b"truncated":
        _save(bad, _u8(16, 16))
        content = bad.read_bytes()[:100]  # a valid header, then cut-off pixel data
    bad.write_bytes(content)
    with _raises_naming(bad, "cannot read image"):
        load_image_folder(tmp_path)


@pytest.mark.parametrize("read", [load_image_folder, read_image_folder])
def test_image_folder_refuses_16_bit_images_when_opened(tmp_path, read):
    deep = tmp_path / "a" / "deep.png"
    deep.parent.mkdir()
    Image.fromarray(np.full((4, 5), 40000, np.uint16)).save(deep)
    with _raises_naming(deep, "not 8-bit"):
        read(tmp_path)


def test_image_folder_empty_root_and_no_images(tmp_path):
    with _raises_naming(tmp_path, "no class sub-folders"):
        load_image_folder(tmp_path)
    (tmp_path / "a").mkdir()
    with _raises_naming(tmp_path, "no images"):
        load_image_folder(tmp_path)


# --- CIFAR-10 ------------------------------------------------------------------------------------


def _cifar_batch(path: Path, n: int, first_label: int, protocol: int = 2) -> np.ndarray:
    """Write a batch whose planes are known: returns the expected (N, 3, 32, 32) uint8 images."""
    images = _u8(n, 3, 32, 32)
    rows = np.concatenate([images[:, c].reshape(n, -1) for c in range(3)], axis=1)  # R, G, B
    labels = [(first_label + i) % 10 for i in range(n)]
    batch = {b"batch_label": b"x", b"data": rows, b"labels": labels}
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    return images


def test_cifar_round_trip_with_meta(tmp_path):
    train1 = _cifar_batch(tmp_path / "data_batch_1", 3, 0)
    train2 = _cifar_batch(tmp_path / "data_batch_2", 2, 3, protocol=5)
    test = _cifar_batch(tmp_path / "test_batch", 2, 5)
    names = [f"c{i}".encode() for i in range(10)]
    (tmp_path / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}, protocol=2))

    train_data = load_cifar10_batches(tmp_path)
    assert train_data.x.shape == (5, 3, 32, 32)
    np.testing.assert_array_equal(_as_u8(train_data.x), np.concatenate([train1, train2]))
    np.testing.assert_array_equal(train_data.y, [0, 1, 2, 3, 4])
    assert train_data.classes == tuple(f"c{i}" for i in range(10))

    test_data = load_cifar10_batches(tmp_path, split="test")
    np.testing.assert_array_equal(_as_u8(test_data.x[0, 0]), test[0, 0])  # channel 0 is R
    np.testing.assert_array_equal(test_data.y, [5, 6])


def test_cifar_str_keys_and_default_names(tmp_path):
    rows = np.zeros((1, 3072), np.uint8)
    rows[0, 1024:2048] = 255  # the G plane
    (tmp_path / "test_batch").write_bytes(pickle.dumps({"data": rows, "labels": [9]}))
    data = load_cifar10_batches(tmp_path, split="test")
    assert data.classes == CIFAR10_CLASSES
    assert data.x[0, 1].min() == 1.0
    assert data.x[0, [0, 2]].max() == 0.0


class _Evil:
    def __init__(self, call: tuple) -> None:
        self.call = call

    def __reduce__(self) -> tuple:
        return self.call


@pytest.mark.parametrize("attack", ["os.system", "builtins.open"])
def test_cifar_refuses_forbidden_globals(tmp_path, attack):
    marker = tmp_path / "pwned"
    call = (
        (os.system, (f"touch {shlex.quote(str(marker))}",))
        if attack == "os.system"
        else (open, (str(marker), "w"))
    )
    batch = tmp_path / "data_batch_1"
    payload = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [_Evil(call)]}
    batch.write_bytes(pickle.dumps(payload, protocol=2))
    with _raises_naming(batch, "refusing to unpickle"):
        load_cifar10_batches(tmp_path)
    assert not marker.exists()


def test_cifar_bad_batches(tmp_path):
    with _raises_naming(tmp_path, "no training batches"):
        load_cifar10_batches(tmp_path)
    with _raises_naming(tmp_path / "test_batch", "no such file"):
        load_cifar10_batches(tmp_path, split="test")
    batch = tmp_path / "data_batch_1"
    batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with _raises_naming(batch, "100 columns"):
        load_cifar10_batches(tmp_path)
    batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}))
    with _raises_naming(batch, "2 images but 1 labels"):
        load_cifar10_batches(tmp_path)
    batch.write_bytes(b"\x80\x02garbage")
    with _raises_naming(batch, "cannot unpickle"):
        load_cifar10_batches(tmp_path)


def test_cifar_empty_label_names(tmp_path):
    _cifar_batch(tmp_path / "data_batch_1", 1, 0)
    (tmp_path / "batches.meta").write_bytes(pickle.dumps({b"label_names": []}))
    with _raises_naming(tmp_path, "class list is empty"):
        load_cifar10_batches(tmp_path)


# --- IDX ----------------------------------------------------------------------------------------

_IDX_TYPES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C}
_IDX_TYPES |= {np.float32: 0x0D, np.float64: 0x0E}


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, _IDX_TYPES[array.dtype.type], array.ndim])
    dims = struct.pack(f">{array.ndim}I", *array.shape)
    return header + dims + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> Path:
    raw = _idx_bytes(array)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.mark.parametrize("label_dtype", [np.uint8, np.int8, np.int16, np.int32])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip_ubyte(tmp_path, label_dtype, gz):
    x, y = _u8(4, 3, 5), np.array([0, 2, 1, 2], dtype=label_dtype)
    images = _write_idx(tmp_path / "images", x, gz=gz)  # no .gz suffix: detected by magic
    labels = _write_idx(tmp_path / "labels", y, gz=gz)
    data = load_idx(images, labels)
    assert data.x.shape == (4, 1, 3, 5)
    np.testing.assert_array_equal(_as_u8(data.x[:, 0]), x)
    np.testing.assert_array_equal(data.y, y)
    assert data.classes == ("0", "1", "2")
    assert data.source == str(images)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_idx_float_images(tmp_path, dtype):
    x = np.linspace(0, 1, 2 * 2 * 3, dtype=dtype).reshape(2, 2, 3)
    images = _write_idx(tmp_path / "images.gz", x, gz=True)
    labels = _write_idx(tmp_path / "labels", np.array([1, 0], np.uint8))
    np.testing.assert_array_equal(load_idx(images, labels).x[:, 0], x.astype(np.float32))


def test_idx_bad_files(tmp_path):
    good_images = _write_idx(tmp_path / "images", _u8(3, 2, 2))
    labels = _write_idx(tmp_path / "labels", np.array([0, 1, 0], np.uint8))

    truncated = tmp_path / "truncated"
    truncated.write_bytes(good_images.read_bytes()[:-1])
    with _raises_naming(truncated, "truncated"):
        load_idx(truncated, labels)

    wrong_magic = tmp_path / "wrong_magic"
    wrong_magic.write_bytes(b"\x01\x02" + good_images.read_bytes()[2:])
    with _raises_naming(wrong_magic, "not an IDX file"):
        load_idx(wrong_magic, labels)

    short_labels = _write_idx(tmp_path / "short_labels", np.array([0, 1], np.uint8))
    with _raises_naming(good_images, "3 images but .*short_labels has 2 labels"):
        load_idx(good_images, short_labels)

    int_images = _write_idx(tmp_path / "int_images", np.zeros((3, 2, 2), np.int16))
    with _raises_naming(int_images, "dtype int16"):
        load_idx(int_images, labels)

    flat_images = _write_idx(tmp_path / "flat_images", np.zeros((3, 4), np.uint8))
    with _raises_naming(flat_images, "3-D"):
        load_idx(flat_images, labels)

    float_labels = _write_idx(tmp_path / "float_labels", np.zeros(3, np.float32))
    with _raises_naming(float_labels, "integer"):
        load_idx(good_images, float_labels)

    bad_gzip = tmp_path / "bad_gzip"
    bad_gzip.write_bytes(gzip.compress(good_images.read_bytes())[:-8])
    with _raises_naming(bad_gzip, "cannot read"):
        load_idx(bad_gzip, labels)


# --- load_dataset -------------------------------------------------------------------------------


def test_load_dataset_infers_each_format(tmp_path):
    npz = tmp_path / "d.NPZ"
    with npz.open("wb") as handle:  # np.savez would append ".npz" to a path
        np.savez(handle, x=_u8(2, 3, 3), y=np.array([0, 1]))
    assert load_dataset(npz).source == str(npz)
    assert load_dataset(npz, classes=["a", "b"]).classes == ("a", "b")

    folder = tmp_path / "folder"
    _save(folder / "cls" / "1.png", _u8(3, 3))
    assert load_dataset(folder, color="rgb").input_shape == (3, 3, 3)

    cifar = tmp_path / "cifar"
    cifar.mkdir()
    _cifar_batch(cifar / "test_batch", 2, 0)
    assert len(load_dataset(cifar, split="test")) == 2

    images = _write_idx(tmp_path / "images", _u8(2, 3, 3))
    labels = _write_idx(tmp_path / "labels", np.array([0, 1], np.uint8))
    assert len(load_dataset(images, labels=labels)) == 2
    assert len(load_dataset(images, format="idx", labels=labels)) == 2
    with _raises_naming(images, "labels="):
        load_dataset(images, format="idx")


def test_load_dataset_errors(tmp_path):
    expected = "unknown format 'hdf5'; expected one of: npz, folder, cifar10, idx"
    with _raises_naming(tmp_path, expected):
        load_dataset(tmp_path, format="hdf5")
    other = tmp_path / "data.csv"
    other.write_text("1,2")
    with _raises_naming(other, "cannot infer the format.*npz, folder, cifar10, idx"):
        load_dataset(other)
    with _raises_naming(tmp_path / "gone", "no such file or directory"):
        load_dataset(tmp_path / "gone")


def test_a_csv_handed_to_the_npz_loader_is_named_as_text(tmp_path):
    """The walkthrough's CSV got numpy's advice to load it with allow_pickle (which runs the file's code)."""
    path = tmp_path / "train.npz"
    path.write_text("label,p0,p1\n3,0,255\n")
    with _raises_naming(path, r"not an \.npz archive \(it looks like CSV/text") as raised:
        load_npz(path)
    assert "allow_pickle" not in str(raised.value)
    assert "numpy.savez" in str(raised.value)


@settings(max_examples=60, deadline=None)
@given(content=st.binary(max_size=64))
def test_no_file_the_npz_loader_refuses_gets_the_allow_pickle_advice(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("npz") / "d.npz"
    path.write_bytes(content)
    with pytest.raises(DataError) as raised:
        load_npz(path)
    assert "allow_pickle" not in str(raised.value)


def test_an_archive_of_python_objects_is_refused_without_the_allow_pickle_advice(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with _raises_naming(path, "Python objects") as raised:
        load_npz(path)
    assert "allow_pickle" not in str(raised.value)
