"""Image files of any size and mode, made into a plan's `[model] image_shape` the same way at every silo.

A plan's `[data.images]` section says how (`ImageSettings`); the files are listed and their headers checked
when a silo opens them (`read_image_folder`), and decoded only when a plan asks for them (`prepared`), one
image at a time into one preallocated array. Every silo that holds the same file computes the same pixels:
one Pillow filter, one order of operations, no randomness. The file checks every loader shares (`existing`,
`reading`) live here too, below `fedlt.data.files` and `fedlt.data.dicom`, which both build on this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageMode, ImageOps

from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.errors import DataError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff"})

# Pillow's BILINEAR is a triangle filter whose support widens with the reduction factor, so a downscale
# averages every source pixel (no aliasing, unlike NEAREST), and its weights are never negative, so a solid
# image stays solid and no pixel leaves the range of its neighbours (BICUBIC and LANCZOS overshoot at edges
# and would need clipping). Pillow computes it in fixed point for 8-bit images, the same bytes on every
# machine with the same Pillow; float images (DICOM) in double precision, which a compiler that fuses
# multiply-adds (some ARM builds) may round differently in the last bit.
DICOM_LABELS = "labels.csv"  # a DICOM folder's labels (file,label), by default beside its files

RESAMPLING = Image.Resampling.BILINEAR

# image_shape's channels -> the Pillow mode an 8-bit image is converted to (ITU-R 601-2 luma for "L";
# a gray image's plane repeated for "RGB")
CHANNEL_MODES = {1: "L", 3: "RGB"}


# --- resizing ------------------------------------------------------------------------------------


def _as_is(image: Image.Image, _size: tuple[int, int]) -> Image.Image:
    return image


def _stretch(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    return image.resize(size, RESAMPLING)


def _crop(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    return ImageOps.fit(image, size, RESAMPLING)


def _pad(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Not `ImageOps.pad`: its `contain` shrinks a thin side to 0 pixels (a 64x1 image in 16x16 comes back
    blank); here every side keeps at least one pixel."""
    scale = min(size[0] / image.width, size[1] / image.height)
    inner = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    canvas = Image.new(image.mode, size, 0)
    canvas.paste(image.resize(inner, RESAMPLING), ((size[0] - inner[0]) // 2, (size[1] - inner[1]) // 2))
    return canvas


# name -> how an image of any size becomes (width, height); every one returns an image of exactly that size
# (or, "none", the image itself, whose size was checked before decoding)
RESIZERS: dict[str, Callable[[Image.Image, tuple[int, int]], Image.Image]] = {
    "none": _as_is,
    "stretch": _stretch,
    "crop": _crop,
    "pad": _pad,
}


@dataclass(frozen=True)
class ImageSettings:
    """A plan's `[data.images]`: how every silo makes its image files the size of `[model] image_shape`
    (channels, height, width): 1 channel is grayscale, 3 are RGB (a gray image's plane repeated).

    `resize`: "none" takes images only of the plan's size; "stretch" scales each side to it (aspect ignored);
    "crop" scales the image to cover it, then keeps the centre; "pad" scales the image to fit inside it and
    centres it on black (0). All resample with `RESAMPLING`.

    `window` = [center, width] maps DICOM values (after the modality LUT: Hounsfield units for CT) from
    center − width/2 .. center + width/2 onto 0..1, clipping outside, alike at every silo (a CT lung window is
    [-600, 1500]); empty, each DICOM image is scaled by its own min..max instead (`fedlt.data.dicom`).
    """

    resize: str = setting("none", choices=tuple(RESIZERS), doc="none, stretch, crop or pad")
    window: tuple[float, ...] = setting(
        (), doc="DICOM only: [center, width] in modality units (CT: HU); empty: each image's own min..max"
    )

    def problems(self, image_shape: Sequence[int]) -> list[str]:
        """What the field checks cannot see: the window's form and the channels an image can have (the
        shape's own form, [channels, height, width], is `[model]`'s check)."""
        problems = []
        window = self.window
        if window and (len(window) != 2 or not all(map(math.isfinite, window)) or window[1] <= 0):
            problems.append(
                f"data.images.window: expected [center, width] with a width > 0, got {list(window)}"
            )
        if len(image_shape) == 3 and image_shape[0] not in CHANNEL_MODES:
            problems.append(
                f"model.image_shape: images have 1 (grayscale) or 3 (RGB) channels, got {image_shape[0]}"
            )
        return problems


# --- file checks every loader shares ---------------------------------------------------------


@contextmanager
def reading(source: Path, action: str) -> Iterator[None]:
    """Re-raise a library's exception as a DataError naming the file.

    numpy, Pillow, pydicom, gzip and pickle raise many unrelated exception types on bad input, so any
    exception is caught; our own DataErrors pass through untouched.
    """
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        raise DataError(source, f"{action}: {exc}") from exc


def existing(path: str | Path, *, directory: bool | None = None) -> Path:
    """Fail early with one clear message rather than deep inside a library; None accepts either."""
    p = Path(path)
    if not p.exists():
        raise DataError(p, "no such file or directory")
    if directory is True and not p.is_dir():
        raise DataError(p, "expected a directory, found a file")
    if directory is False and p.is_dir():
        raise DataError(p, "expected a file, found a directory")
    return p


# --- an image folder -----------------------------------------------------------------------------


def class_folders(root: Path) -> list[Path]:
    """One sub-folder per class, sorted by name (the class's name); hidden folders are not classes."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(root, "no class sub-folders (put each class's images in its own folder)")
    return folders


def labelled_files(root: Path) -> tuple[tuple[str, ...], list[tuple[Path, int]]]:
    """The classes (their folders' names) and every image file with its class's index; an error if there
    is no image."""
    folders = class_folders(root)
    files = [(f, label) for label, folder in enumerate(folders) for f in image_files(folder)]
    if not files:
        raise DataError(root, f"no images with extensions {', '.join(sorted(IMAGE_EXTENSIONS))}")
    return tuple(folder.name for folder in folders), files


def image_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )


def header(file: Path) -> tuple[str, tuple[int, int], int]:
    """An 8-bit image's mode, (width, height) and number of frames, from its header alone.

    Deeper images (16-bit PNG or TIFF, float TIFF) are refused rather than converted: how their values map
    to [0, 1] (the full 16-bit range, 12 bits stored in 16, a window) is not in the file, and Pillow's
    conversion to 8 bits clips rather than scales."""
    with reading(file, "cannot read image"), Image.open(file) as image:
        mode, size, frames = image.mode, image.size, getattr(image, "n_frames", 1)
    if ImageMode.getmode(mode).typestr not in ("|u1", "|b1"):
        raise DataError(
            file,
            f"image mode {mode} is not 8-bit, the only depth supported (convert it to 8 bits with the "
            "scaling you mean; medical images at their own depth can be read as DICOM)",
        )
    return mode, size, frames


def different_size(size: tuple[int, int], first: Path, first_size: tuple[int, int]) -> str:
    """Why a folder of one-size images refuses this one (`load_image_folder`, `load_dicom_folder`)."""
    return (
        f"image is {size[0]}x{size[1]} but {first.parent.name}/{first.name} is "
        f"{first_size[0]}x{first_size[1]}; all images must have the same size"
    )


@dataclass(frozen=True)
class ImageEntry:
    """One file of a folder, as its header describes it; its pixels are read only when prepared."""

    file: Path
    label: int
    width: int
    height: int


@dataclass(frozen=True)
class ImageFiles:
    """A folder's image files, listed and checked but not decoded, ready to be prepared for any plan.

    `classes` names the label indices (the folders' names, sorted, including folders with no images)."""

    entries: tuple[ImageEntry, ...]
    classes: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.entries)

    def prepared(self, image_shape: tuple[int, int, int], settings: ImageSettings) -> LabeledData:
        """Every image decoded, in the plan's channels, made (height, width) as `settings.resize` says, as
        float32 in [0, 1], (N, C, H, W): one image in memory at a time besides the result.

        With resize "none", an image of another size is a DataError naming it, before any is decoded."""
        problems = settings.problems(image_shape)
        if len(image_shape) != 3 or min(image_shape) < 1:
            problems.append(f"model.image_shape: expected [channels, height, width], got {list(image_shape)}")
        if problems:
            raise DataError(self.source, "; ".join(problems))
        channels, height, width = image_shape
        if settings.resize == "none":
            self._check_sizes(width, height)
        resize = RESIZERS[settings.resize]
        x = np.empty((len(self.entries), channels, height, width), dtype=np.float32)
        for index, entry in enumerate(self.entries):
            with reading(entry.file, "cannot read image"):
                image = self._decoded(entry.file, channels, settings)
                x[index] = _unit_planes(resize(image, (width, height)))
        y = np.array([entry.label for entry in self.entries], dtype=np.int64)
        return LabeledData(x, y, self.classes, self.source)

    def _decoded(self, file: Path, channels: int, settings: ImageSettings) -> Image.Image:
        """The file's pixels in the plan's channels: 8-bit "L" or "RGB" (alpha dropped, palettes applied);
        `settings.window` is for DICOM's values, not 8-bit pixels."""
        with Image.open(file) as image:
            return image.convert(CHANNEL_MODES[channels])

    def _check_sizes(self, width: int, height: int) -> None:
        for entry in self.entries:
            if (entry.width, entry.height) != (width, height):
                raise DataError(
                    entry.file,
                    f"image is {entry.width}x{entry.height} (width x height) but the plan's image_shape "
                    f"asks for {width}x{height}, and [data.images] resize is 'none'; set resize to "
                    "'stretch', 'crop' or 'pad' to resize every image",
                )


def _unit_planes(image: Image.Image) -> np.ndarray:
    """(C, H, W) or (H, W) in [0, 1]: 8-bit values over 255 (as every loader scales them), a float image's
    values clipped, as resampling may round a hair past its range; (H, W) fills every channel."""
    if image.mode == "F":
        return np.clip(np.asarray(image, dtype=np.float32), 0.0, 1.0)
    pixels = np.asarray(image, dtype=np.float32) / np.float32(255)
    return pixels.transpose(2, 0, 1) if pixels.ndim == 3 else pixels


def read_image_folder(path: str | Path) -> ImageFiles:
    """One sub-folder per class (as `load_image_folder`), PNG/JPEG/... of mixed sizes and modes; only the
    headers are read: every file must open and be 8-bit, with one frame.

    EXIF orientation is not applied: pixels are used as stored, as every other loader does."""
    root = existing(path, directory=True)
    classes, files = labelled_files(root)
    entries = []
    for file, label in files:
        _, (width, height), frames = header(file)
        if frames != 1:
            raise DataError(
                file, f"image has {frames} frames; only single-frame images are read (save each as its own)"
            )
        entries.append(ImageEntry(file, label, width, height))
    return ImageFiles(tuple(entries), classes, str(root))
