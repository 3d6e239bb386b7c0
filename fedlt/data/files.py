"""Loaders for a silo's own image data on disk, so a hospital or bank can join with its own files.

Every loader returns `LabeledData` and turns every problem with the files into a `DataError` that
names the offending file, so the CLIs can print one clear line instead of a library's traceback.
`open_source` is the door a silo uses: image and DICOM folders of any size stay files until a plan
prepares them (`fedlt.data.images`, `fedlt.data.dicom`).
"""

from __future__ import annotations

import gzip
import math
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageMode

from fedlt.data.arrays import LabeledData
from fedlt.data.images import (
    DICOM_LABELS,
    ImageFiles,
    different_size,
    existing,
    header,
    labelled_files,
    read_image_folder,
    reading,
)
from fedlt.errors import DataError

Color = Literal["gray", "rgb"]
Split = Literal["train", "test"]

CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

# IDX type byte -> big-endian element type (the format stores everything big-endian).
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# The only globals a pickle of numpy arrays needs; anything else could run code on unpickling.
_PICKLE_ALLOWED = frozenset(
    {
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),  # arrays pickled with protocol 5
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes pickled by Python 3 with protocol <= 2
    }
)

_GZIP_MAGIC = b"\x1f\x8b"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry, or an empty zip: np.load's .npz
_NPY_MAGIC = b"\x93NUMPY"
_PICKLE_MAGIC = b"\x80"
_SNIFF_BYTES = 512
_NPZ_HINT = "write one with numpy.savez(path, x=images, y=labels), images uint8 or floats in [0, 1]"
_CIFAR_SIDE = 32
_CIFAR_COLUMNS = 3 * _CIFAR_SIDE * _CIFAR_SIDE


# --- shared helpers ---------------------------------------------------------------------------


def _to_nchw(x: np.ndarray, source: Path) -> np.ndarray:
    """Bring the layouts people actually save into (N, C, H, W); channels-last wins ties."""
    if x.ndim == 3:
        return x[:, np.newaxis]
    if x.ndim == 4 and x.shape[3] in (1, 3):
        return x.transpose(0, 3, 1, 2)
    if x.ndim == 4 and x.shape[1] in (1, 3):
        return x
    layouts = "(N, H, W), (N, H, W, C) or (N, C, H, W) with C = 1 or 3"
    raise DataError(source, f"images have shape {x.shape}; expected {layouts}")


def _to_unit_float(x: np.ndarray, source: Path) -> np.ndarray:
    """Scale 8-bit pixels to [0, 1]; refuse floats that are not already there rather than guess."""
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255)
    if not np.issubdtype(x.dtype, np.floating):
        raise DataError(source, f"image dtype {x.dtype.name} is neither uint8 nor float in [0, 1]")
    if x.size:
        if not np.isfinite(x).all():
            raise DataError(source, "float images contain NaN or infinite values")
        low, high = float(x.min()), float(x.max())
        if low < 0.0 or high > 1.0:
            raise DataError(
                source,
                f"float images must already be scaled to [0, 1]; found min {low:g}, max {high:g}",
            )
    return x.astype(np.float32)


def _to_labels(y: Any, source: Path) -> np.ndarray:
    """Accept any integer type but not floats: a float label usually means the wrong array."""
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(source, f"labels must be 1-D integers, got {y.dtype} {y.shape}")
    return y.astype(np.int64)


def _numbered_classes(y: np.ndarray, source: Path) -> tuple[str, ...]:
    """Name classes "0".."max label" when the files carry no names."""
    if not y.size:
        raise DataError(source, "no labels to infer the classes from")
    if y.min() < 0:
        raise DataError(source, f"labels must be non-negative, found {int(y.min())}")
    return tuple(str(i) for i in range(int(y.max()) + 1))


# --- npz ----------------------------------------------------------------------------------------


def load_npz(path: str | Path, *, classes: Sequence[str] | None = None) -> LabeledData:
    """Load an .npz with arrays `x`, `y` and optionally `classes`; pickle is refused."""
    source = existing(path, directory=False)
    _check_npz_magic(source)
    with reading(source, "cannot read as .npz"):
        archive = np.load(source, allow_pickle=False)
    with archive, reading(source, "cannot read array from .npz"), _refusing_pickles(source):
        missing = [name for name in ("x", "y") if name not in archive.files]
        if missing:
            found = ", ".join(archive.files) or "none"
            raise DataError(source, f"missing array(s) {', '.join(missing)} (found: {found})")
        x, y = archive["x"], archive["y"]
        stored = archive["classes"] if "classes" in archive.files else None
    labels = _to_labels(y, source)
    if classes is not None:
        names = tuple(classes)
    elif stored is not None:
        names = _stored_class_names(stored, source)
    else:
        names = _numbered_classes(labels, source)
    images = _to_unit_float(_to_nchw(x, source), source)
    return LabeledData(images, labels, names, str(source))


def _check_npz_magic(source: Path) -> None:
    """An .npz is a zip archive; numpy reads anything else as a pickle and, refusing it, advises
    `allow_pickle`, which would run code from the file. Say what the file is instead."""
    with reading(source, "cannot read"), source.open("rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    if head.startswith(_ZIP_MAGIC):
        return
    if head.startswith(_NPY_MAGIC):
        raise DataError(source, "holds a single array (.npy), not an .npz archive with arrays 'x' and 'y'")
    if not head:
        what = "it is empty"
    elif _looks_like_text(head):
        what = "it looks like CSV/text"
    elif head.startswith(_PICKLE_MAGIC):
        what = "it looks like a Python pickle, which is never loaded: unpickling runs code from the file"
    else:
        what = f"an .npz is a zip archive, starting 'PK'; this file starts with bytes {head[:4].hex(' ')}"
    raise DataError(source, f"not an .npz archive ({what}); {_NPZ_HINT}")


def _looks_like_text(head: bytes) -> bool:
    text = head.decode("utf-8", errors="replace")
    readable = sum(c != "\ufffd" and (c.isprintable() or c in "\t\r\n") for c in text)
    return b"\0" not in head and readable >= 0.95 * len(text)


@contextmanager
def _refusing_pickles(source: Path) -> Iterator[None]:
    """An array of Python objects inside an archive is a pickle too: refused, without numpy's advice."""
    try:
        yield
    except ValueError as exc:
        if "allow_pickle" not in str(exc):
            raise
        raise DataError(
            source, f"an array holds Python objects (pickled), which are never loaded; {_NPZ_HINT}"
        ) from None


def _stored_class_names(stored: np.ndarray, source: Path) -> tuple[str, ...]:
    if stored.ndim != 1 or stored.dtype.kind not in "US":
        raise DataError(source, f"array 'classes' must be 1-D strings, got {stored.dtype.name}")
    with reading(source, "cannot decode array 'classes'"):
        return tuple(s.decode() if isinstance(s, bytes) else str(s) for s in stored.tolist())


# --- image folder ------------------------------------------------------------------------------


def load_image_folder(path: str | Path, *, color: Color | None = None) -> LabeledData:
    """Load one sub-folder per class, every image of one size; `color=None` keeps colour only if some image
    has it. Images of mixed sizes are prepared for a plan instead (`open_source`, `fedlt.data.images`)."""
    root = existing(path, directory=True)
    if color not in (None, "gray", "rgb"):
        raise DataError(root, f"color must be 'gray', 'rgb' or None, got {color!r}")
    classes, files = labelled_files(root)
    modes = _check_headers([file for file, _ in files])
    if color is None:
        color = "rgb" if any(ImageMode.getmode(m).basemode != "L" for m in modes) else "gray"
    pixels = np.stack([_read_pixels(file, "RGB" if color == "rgb" else "L") for file, _ in files])
    labels = np.array([label for _, label in files], dtype=np.int64)
    images = _to_unit_float(_to_nchw(pixels, root), root)
    return LabeledData(images, labels, classes, str(root))


def _check_headers(files: list[Path]) -> set[str]:
    """Read only the headers, so a size or depth mismatch is reported before decoding any pixels."""
    modes: set[str] = set()
    first, first_size = files[0], header(files[0])[1]
    for file in files:
        mode, size, _ = header(file)
        if size != first_size:
            raise DataError(file, different_size(size, first, first_size))
        modes.add(mode)
    return modes


def _read_pixels(file: Path, mode: str) -> np.ndarray:
    with reading(file, "cannot read image"), Image.open(file) as image:
        return np.asarray(image.convert(mode))


# --- CIFAR-10 python batches -------------------------------------------------------------------


def load_cifar10_batches(path: str | Path, *, split: Split = "train") -> LabeledData:
    """Load the CIFAR-10 "python version" directory without trusting its pickles."""
    root = existing(path, directory=True)
    if split == "train":
        batch_files = [root / f"data_batch_{i}" for i in range(1, 6)]
        batch_files = [p for p in batch_files if p.is_file()]
        if not batch_files:
            raise DataError(root, "no training batches data_batch_1 .. data_batch_5")
    elif split == "test":
        batch_files = [existing(root / "test_batch", directory=False)]
    else:
        raise DataError(root, f"split must be 'train' or 'test', got {split!r}")
    batches = [_read_cifar_batch(p) for p in batch_files]
    meta = root / "batches.meta"
    classes = _cifar_class_names(meta) if meta.is_file() else CIFAR10_CLASSES
    x = np.concatenate([images for images, _ in batches])
    y = np.concatenate([labels for _, labels in batches])
    return LabeledData(_to_unit_float(x, root), y, classes, str(root))


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Refuses every global except the numpy array machinery, so a crafted file cannot run code."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("numpy.core."):  # pickles written by numpy 1.x
            module = "numpy._core." + module.removeprefix("numpy.core.")
        if (module, name) not in _PICKLE_ALLOWED:
            raise DataError(self._source, f"refusing to unpickle {module}.{name}")
        return super().find_class(module, name)


def _unpickle_dict(file: Path) -> dict[Any, Any]:
    with reading(file, "cannot unpickle"), file.open("rb") as handle:
        loaded = _NumpyOnlyUnpickler(handle, file).load()
    if not isinstance(loaded, dict):
        raise DataError(file, f"expected a pickled dict, found {type(loaded).__name__}")
    return loaded


def _field(batch: dict[Any, Any], key: str, file: Path) -> Any:
    """Look a key up as bytes (the official Python 2 pickles) or as str (re-saved ones)."""
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    raise DataError(file, f"missing key {key!r}")


def _read_cifar_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle_dict(file)
    data, labels = _field(batch, "data", file), _to_labels(_field(batch, "labels", file), file)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise DataError(file, "'data' must be a 2-D uint8 array")
    if data.shape[1] != _CIFAR_COLUMNS:
        raise DataError(file, f"'data' has {data.shape[1]} columns, expected {_CIFAR_COLUMNS}")
    if data.shape[0] != labels.shape[0]:
        raise DataError(file, f"{data.shape[0]} images but {labels.shape[0]} labels")
    # Each row holds the whole R plane, then G, then B: that is already channels-first.
    return data.reshape(-1, 3, _CIFAR_SIDE, _CIFAR_SIDE), labels


def _cifar_class_names(meta: Path) -> tuple[str, ...]:
    names = _field(_unpickle_dict(meta), "label_names", meta)
    if not isinstance(names, list | tuple) or not all(isinstance(n, bytes | str) for n in names):
        raise DataError(meta, "'label_names' must be a list of strings")
    with reading(meta, "cannot decode 'label_names'"):
        return tuple(n.decode() if isinstance(n, bytes) else n for n in names)


# --- IDX (MNIST) ---------------------------------------------------------------------------------


def load_idx(images_path: str | Path, labels_path: str | Path) -> LabeledData:
    """Load an IDX image/label pair (MNIST's format), gzipped or not."""
    images_file = existing(images_path, directory=False)
    labels_file = existing(labels_path, directory=False)
    images, labels = _read_idx(images_file), _read_idx(labels_file)
    if images.ndim != 3:
        raise DataError(images_file, f"IDX images must be 3-D (N, H, W), got shape {images.shape}")
    y = _to_labels(labels, labels_file)
    if images.shape[0] != y.shape[0]:
        raise DataError(images_file, f"{len(images)} images but {labels_file} has {len(y)} labels")
    x = _to_unit_float(_to_nchw(images, images_file), images_file)
    return LabeledData(x, y, _numbered_classes(y, labels_file), str(images_file))


def _read_idx(file: Path) -> np.ndarray:
    with reading(file, "cannot read"):
        raw = file.read_bytes()
        if raw.startswith(_GZIP_MAGIC):
            raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES:
        raise DataError(file, f"not an IDX file (magic bytes {raw[:4].hex() or 'missing'})")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(file, "truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected, found = math.prod(shape) * dtype.itemsize, len(raw) - header
    if found != expected:
        problem = "truncated" if found < expected else "trailing bytes after the data"
        raise DataError(file, f"{problem}: shape {shape} needs {expected} bytes, found {found}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


# --- one door -----------------------------------------------------------------------------------


def _load_idx_option(path: str | Path, *, labels: str | Path | None = None) -> LabeledData:
    if labels is None:
        raise DataError(path, "the idx format needs the labels file: pass labels=<path>")
    return load_idx(path, labels)


_LOADERS: dict[str, Callable[..., LabeledData]] = {
    "npz": load_npz,
    "folder": load_image_folder,
    "cifar10": load_cifar10_batches,
    "idx": _load_idx_option,
    "dicom": lambda path, **options: _dicom().load_dicom_folder(path, **options),
}

# formats whose files a plan prepares (resized, in its channels) -> the opener and the options it takes
_FILE_SETS: dict[str, tuple[Callable[..., ImageFiles], tuple[str, ...]]] = {
    "folder": (read_image_folder, ()),
    "dicom": (lambda path, **options: _dicom().read_dicom_folder(path, **options), ("labels",)),
}


def _dicom() -> ModuleType:
    """`fedlt.data.dicom`, imported where DICOM is read: pydicom and pandas load only then."""
    from fedlt.data import dicom

    return dicom


def load_dataset(path: str | Path, *, format: str | None = None, **options: Any) -> LabeledData:
    """One entry point for configs and CLIs; infers the format when it is not given. Images are taken at
    the size the files have (one size for all); `open_source` has them prepared for a plan instead."""
    if format is None:
        format = _infer_format(path, options)
    loader = _LOADERS.get(format)
    if loader is None:
        raise DataError(path, f"unknown format {format!r}; expected one of: {', '.join(_LOADERS)}")
    return loader(path, **options)


def open_source(path: str | Path, *, format: str | None = None, **options: Any) -> ImageFiles | LabeledData:
    """A silo's files as a plan will want them: an image or DICOM folder opened with its headers checked but
    nothing decoded (`ImageFiles.prepared` makes it the plan's image_shape), or arrays (npz, cifar10, idx)
    loaded as `load_dataset` does, since they are not resized. Infers the format when it is not given."""
    if format is None:
        format = _infer_format(path, options)
    if format not in _FILE_SETS:
        return load_dataset(path, format=format, **options)
    opener, accepted = _FILE_SETS[format]
    unknown = [name for name in options if name not in accepted]
    if unknown:
        takes = f"only {', '.join(accepted)}" if accepted else "none"
        raise DataError(
            path,
            f"format {format!r} takes options {takes}, got {', '.join(unknown)} (the plan's image_shape "
            "and [data.images] say how images are prepared)",
        )
    return opener(path, **options)


def _infer_format(path: str | Path, options: dict[str, Any]) -> str:
    """A folder holding *.dcm files or a labels.csv is DICOM (other DICOM folders need format="dicom")."""
    path = existing(path)
    if path.is_dir():
        if (path / "data_batch_1").exists() or (path / "test_batch").exists():
            return "cifar10"
        if (path / DICOM_LABELS).is_file() or any(p.suffix.lower() == ".dcm" for p in path.rglob("*")):
            return "dicom"
        return "folder"
    if path.suffix.lower() == ".npz":
        return "npz"
    if "labels" in options:
        return "idx"
    raise DataError(path, f"cannot infer the format; pass format= one of: {', '.join(_LOADERS)}")
