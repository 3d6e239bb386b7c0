"""A folder of DICOM images with a CSV of labels beside it, read through pydicom (the optional extra `dicom`)
and prepared for a plan like any image (`fedlt.data.images`).

Each image's stored values go through its Modality LUT (rescale slope and intercept, or a LUT sequence:
Hounsfield units for CT), then onto [0, 1]: with `[data.images] window = [center, width]`, the values from
center − width/2 to center + width/2 (clipped outside), the same mapping at every silo; without one, each
image's own min..max. Per-image scaling throws away absolute values: 0.5 is −400 HU in one scan and +40 HU in
the next, and a scan's range moves with whatever metal or air it holds. Set a window whenever the values
mean something across images (CT above all: a lung window is [-600, 1500], soft tissue [40, 400]); leave it
empty for modalities without absolute units (X-ray, MRI). MONOCHROME1 images (where higher means darker) are
inverted after scaling, so 1 is bright everywhere. The window here is the plain linear one, not DICOM's VOI
function (PS3.3 C.11.2.1.2, with its half-pixel offsets), so [center, width] means the same values whatever
an image's bit depth; a file's own window (WindowCenter, WindowWidth) is not used, as it differs from file to
file and scanner to scanner.

Only single-frame grayscale images are read: a multi-frame file (a CT series in one file, a cine loop) or a
colour one is refused with the reason; export the frames or slices you train on as files of their own.

Errors name the file and, where the user needs it to act, its geometry (rows, columns, frames, photometric
interpretation), never the value of any other tag: a silo's refusal may reach the aggregator, and a DICOM
header holds patient data.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np
import pandas as pd
from PIL import Image

from fedlt.data.arrays import LabeledData
from fedlt.data.images import (
    DICOM_LABELS as LABELS_FILE,
)
from fedlt.data.images import (
    ImageEntry,
    ImageFiles,
    ImageSettings,
    different_size,
    existing,
    reading,
)
from fedlt.errors import DataError

try:
    import pydicom
    import pydicom.errors
    import pydicom.pixels
except ImportError:  # the optional extra `dicom`: read_dicom_folder says how to install it
    pydicom = None

GRAYSCALE = ("MONOCHROME1", "MONOCHROME2")
_PREAMBLE = 128  # a DICOM file's 128-byte preamble is followed by the magic "DICM"
_MAGIC = b"DICM"
_PIXEL_DATA = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")


class DicomFiles(ImageFiles):
    """A DICOM folder's images, listed and their headers checked, decoded only when prepared (one at a time,
    through pydicom); `classes` are the label values of the CSV, sorted by name as image folders are."""

    def _decoded(self, file: Path, channels: int, settings: ImageSettings) -> Image.Image:
        """The image's values on [0, 1] as a float ("F") image, ready to resize like any other."""
        with reading(file, "cannot decode the DICOM pixel data"):
            dataset = pydicom.dcmread(file)
            values = pydicom.pixels.apply_modality_lut(dataset.pixel_array, dataset).astype(np.float64)
        if values.ndim != 2:
            raise DataError(file, f"pixel data has shape {values.shape}; only one grayscale frame is read")
        if not np.isfinite(values).all():
            raise DataError(file, "pixel data holds NaN or infinite values")
        unit = _unit(values, settings.window)
        if dataset.get("PhotometricInterpretation") == "MONOCHROME1":
            unit = 1.0 - unit
        return Image.fromarray(unit.astype(np.float32))


def _unit(values: np.ndarray, window: tuple[float, ...]) -> np.ndarray:
    """Modality values onto [0, 1]: through the window if there is one, else by the image's own range (a
    constant image is 0)."""
    if window:
        center, width = window
        return np.clip((values - (center - width / 2)) / width, 0.0, 1.0)
    low, high = values.min(), values.max()
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


def read_dicom_folder(path: str | Path, *, labels: str | Path | None = None) -> DicomFiles:
    """Every DICOM file below `path` (named *.dcm, or starting with the DICM preamble; DICOMDIR indexes and
    hidden files are skipped), labelled by the CSV `labels` (default `<path>/labels.csv`) with columns `file`
    (relative to `path`, "/" between folders) and `label`; other columns are ignored.

    Every file must have exactly one row and every row a file; each file's header is checked (readable,
    pixel data, one grayscale frame), its pixels are not decoded."""
    root = existing(path, directory=True)
    if pydicom is None:
        raise DataError(root, "reading DICOM needs pydicom: pip install 'fedlt[dicom]'")
    found = {file.relative_to(root).as_posix(): file for file in _dicom_files(root)}
    if not found:
        raise DataError(root, "no DICOM files (named *.dcm, or starting with the DICM preamble)")
    if labels is None and not (root / LABELS_FILE).is_file():
        raise DataError(
            root / LABELS_FILE,
            "no such file: a DICOM folder's labels are a CSV (columns file,label) here or given by labels=",
        )
    table = existing(root / LABELS_FILE if labels is None else labels, directory=False)
    rows = _label_rows(table, root)
    for key, (line, _) in rows.items():
        if key not in found:
            what = (
                "is not a DICOM file (no .dcm name, no DICM preamble)"
                if (root / key).is_file()
                else "missing"
            )
            raise DataError(root / key, f"listed in {table.name} (line {line}) but {what}")
    for key, file in found.items():
        if key not in rows:
            raise DataError(file, f"has no row in {table}; add a line '{key},<label>' or move the file out")
    classes = tuple(sorted({label for _, label in rows.values()}))
    entries = tuple(_entry(file, classes.index(rows[key][1])) for key, file in found.items())
    return DicomFiles(entries, classes, str(root))


def load_dicom_folder(path: str | Path, *, labels: str | Path | None = None) -> LabeledData:
    """A DICOM folder at its images' own size, which must be one size (as `load_image_folder`), each image
    scaled by its own range; a plan prepares DICOM of any size with its own settings instead."""
    files = read_dicom_folder(path, labels=labels)
    first = files.entries[0]
    for entry in files.entries:
        if (entry.width, entry.height) != (first.width, first.height):
            size, first_size = (entry.width, entry.height), (first.width, first.height)
            raise DataError(entry.file, different_size(size, first.file, first_size))
    return files.prepared((1, first.height, first.width), ImageSettings())


def _dicom_files(root: Path) -> Iterator[Path]:
    for file in sorted(root.rglob("*")):
        relative = file.relative_to(root)
        if any(part.startswith(".") for part in relative.parts) or not file.is_file():
            continue
        if file.name.upper() != "DICOMDIR" and (file.suffix.lower() == ".dcm" or _has_preamble(file)):
            yield file


def _has_preamble(file: Path) -> bool:
    with reading(file, "cannot read"), file.open("rb") as handle:
        return handle.read(_PREAMBLE + len(_MAGIC))[_PREAMBLE:] == _MAGIC


def _label_rows(table: Path, root: Path) -> dict[str, tuple[int, str]]:
    """file (normalised, relative to root) -> (its line in the CSV, its label)."""
    with reading(table, "cannot read as CSV"):
        frame = pd.read_csv(table, dtype=str, keep_default_na=False, skipinitialspace=True)
    missing = [column for column in ("file", "label") if column not in frame.columns]
    if missing:
        found = ", ".join(map(str, frame.columns)) or "none"
        raise DataError(
            table, f"needs columns 'file' and 'label'; missing {', '.join(missing)} (found: {found})"
        )
    rows: dict[str, tuple[int, str]] = {}
    for line, (name, label) in enumerate(zip(frame["file"], frame["label"], strict=True), start=2):
        if not name.strip() or not label.strip():
            raise DataError(table, f"line {line}: empty {'file' if not name.strip() else 'label'}")
        key = PurePosixPath(name.strip().replace("\\", "/")).as_posix()
        if key in rows:
            raise DataError(root / key, f"listed twice in {table.name} (lines {rows[key][0]} and {line})")
        rows[key] = (line, label.strip())
    return rows


def _entry(file: Path, label: int) -> ImageEntry:
    """The file's size from its header, after the checks that need no pixels."""
    with reading(file, "cannot read the DICOM header"):
        try:
            dataset = pydicom.dcmread(file, defer_size="1 KB")
        except pydicom.errors.InvalidDicomError:
            raise DataError(file, "not a DICOM file (no DICM preamble and file meta header)") from None
        if not any(name in dataset for name in _PIXEL_DATA):
            raise DataError(file, "has no pixel data (a structured report or a presentation state?)")
        frames = int(dataset.get("NumberOfFrames") or 1)
        if frames != 1:
            raise DataError(file, f"has {frames} frames; only single-frame images are read (export each)")
        photometric = dataset.get("PhotometricInterpretation")
        if dataset.get("SamplesPerPixel", 1) != 1 or photometric not in GRAYSCALE:
            raise DataError(
                file,
                f"photometric interpretation {photometric}: only grayscale (MONOCHROME1, MONOCHROME2) DICOM "
                "is read; convert colour images to PNG or JPEG for an image folder",
            )
        rows, columns = dataset.get("Rows"), dataset.get("Columns")
        if not rows or not columns:
            raise DataError(file, "has no Rows or Columns in its header")
        return ImageEntry(file, label, int(columns), int(rows))
