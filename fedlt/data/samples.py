"""Sample files for trying a consortium as the hospitals would: each silo's own files, in its own formats.

`python -m fedlt.data.samples --out DIR --silos 3` writes, per silo, training data and a held-out slice as
files a real silo might hold (an image folder of PNGs, or an .npz with a `classes` array in an order of its
own), with classes *named* (`zero` … `nine`), cut from scikit-learn's digits by the long-tail recipe, so some
silos lack the rarest classes. docs/operator.md's first study runs on them; nothing in fedlt reads them
specially.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

from fedlt.data.arrays import LabeledData
from fedlt.data.federation import DataConfig, build_federation
from fedlt.errors import FedltError

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
RECIPE = DataConfig(dataset="digits", imbalance=20.0, alpha=0.5, min_silo_size=20, test_per_class=30)


def write_sample_silos(out: Path, *, silos: int, seed: int = 0) -> list[Path]:
    """Each silo's `train` and `held-out` files under `out/<silo-index>/`; the first silo's training data is
    an image folder, every other's an .npz whose `classes` array lists the names in an order of its own."""
    if out.exists() and any(out.iterdir()):
        raise FedltError(f"{out} is not empty; sample files go into a new folder")
    federation = build_federation(replace(RECIPE, silos=silos), seed=seed)
    test = named(federation.test)
    folders = []
    for index, shard in enumerate(federation.silos):
        folder = out / f"silo-{index}"
        if index == 0:
            write_image_folder(folder / "train", named(shard))
        else:
            write_npz(folder / "train.npz", named(shard), shift=index)
        write_npz(folder / "held-out.npz", test.subset(np.arange(index, len(test), silos)), shift=index)
        folders.append(folder)
    return folders


def named(data: LabeledData) -> LabeledData:
    return LabeledData(data.x, data.y, CLASS_NAMES, data.source)


def write_image_folder(root: Path, data: LabeledData) -> None:
    """One folder per class the data holds (a silo without a class has no folder for it)."""
    for k, (image, label) in enumerate(zip(data.x, data.y, strict=True)):
        folder = root / data.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.rint(image[0] * 255).astype(np.uint8)).save(folder / f"{k:05d}.png")


def write_npz(path: Path, data: LabeledData, *, shift: int) -> None:
    """The classes listed in reverse and rotated by `shift`, as another system might order them: loaders must
    go by name."""
    reverse = data.classes[::-1]
    order = reverse[shift:] + reverse[:shift]
    position = {name: i for i, name in enumerate(order)}
    labels = np.array([position[data.classes[label]] for label in data.y], dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=np.rint(data.x[:, 0] * 255).astype(np.uint8), y=labels, classes=np.array(order))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedlt.data.samples", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="a new folder")
    parser.add_argument("--silos", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.silos < 1:
        parser.error("--silos: at least 1")
    try:
        folders = write_sample_silos(args.out, silos=args.silos, seed=args.seed)
    except FedltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for folder in folders:
        print(f"{folder}: train{'/' if (folder / 'train').is_dir() else '.npz'}, held-out.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
