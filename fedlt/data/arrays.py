"""The one in-memory form of labelled data, images or table rows, that every loader returns and every method
consumes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlt.errors import DataError


@dataclass(frozen=True)
class LabeledData:
    """Samples as float32 in [0, 1], images of shape (N, C, H, W) or table rows of encoded features, shape
    (N, F) (`fedlt.data.table`), with int64 labels in [0, len(classes)).

    `classes` names the label indices; it may list classes with no samples (a silo that lacks a class still
    knows the consortium's class list).
    """

    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]
    source: str = "<memory>"

    def __post_init__(self) -> None:
        problems = validation_problems(self.x, self.y, len(self.classes))
        if problems:
            raise DataError(self.source, "; ".join(problems))

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: (channels, height, width) of an image, (features,) of a table row."""
        return tuple(int(d) for d in self.x.shape[1:])

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.y, minlength=self.num_classes).astype(np.int64)

    def subset(self, indices: np.ndarray) -> LabeledData:
        idx = np.asarray(indices, dtype=np.int64)
        return LabeledData(self.x[idx], self.y[idx], self.classes, self.source)

    def in_label_space(self, classes: tuple[str, ...]) -> LabeledData:
        """These images labelled by the position of their class *name* in `classes` (a plan's label space).

        Files name their classes themselves (folder names, an npz `classes` array, "0".."9" for bare integer
        labels), in an order of their own: `1`, `10`, `2` sort as text, a hospital's folders as its staff
        named them. Matching by position would silently give every sample another class's label, so only names
        count. Classes of the plan a silo lacks are fine (the long tail); a class its files name that the plan
        does not is an error that lists both (training on it under some other label would corrupt the model),
        whether or not the silo holds samples of it."""
        if self.classes == tuple(classes):
            return self
        position = {name: index for index, name in enumerate(classes)}
        # every class the files name, held or not: which classes a silo holds samples of is its own business,
        # and a plan leaving one out must not learn it from whether the silo refuses
        unknown = [name for name in self.classes if name not in position]
        if unknown:
            raise DataError(
                self.source,
                f"names classes {unknown} that the plan does not name; the plan's classes are "
                f"{list(classes)} (labels are matched by name: rename the folders or the npz 'classes' "
                "array, or ask the operator to add the class to [model] classes; files without names have "
                "their integer labels named '0', '1', ...)",
            )
        mapping = np.array([position.get(name, -1) for name in self.classes], dtype=np.int64)
        return LabeledData(self.x, mapping[self.y], tuple(classes), self.source)


def validation_problems(x: np.ndarray, y: np.ndarray, num_classes: int) -> list[str]:
    """Every reason the arrays are not valid LabeledData; empty when they are."""
    problems: list[str] = []
    if num_classes < 1:
        problems.append("the class list is empty")
    if not isinstance(x, np.ndarray) or x.ndim not in (2, 4):
        shape = getattr(x, "shape", type(x))
        problems.append(f"samples must have shape (N, C, H, W) or (N, features), got {shape}")
    elif x.dtype != np.float32:
        problems.append(f"samples must be float32, got {x.dtype}")
    elif x.size and not (np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0):
        problems.append("sample values must be finite and within [0, 1]")
    if not isinstance(y, np.ndarray) or y.ndim != 1:
        problems.append(f"labels must be one-dimensional, got {getattr(y, 'shape', type(y))}")
    elif y.dtype != np.int64:
        problems.append(f"labels must be int64, got {y.dtype}")
    elif y.size and num_classes >= 1 and (y.min() < 0 or y.max() >= num_classes):
        bad = np.unique(y[(y < 0) | (y >= num_classes)])[:5].tolist()
        problems.append(f"labels out of range [0, {num_classes}): {bad}")
    if not problems and x.shape[0] != y.shape[0]:
        problems.append(f"{x.shape[0]} images but {y.shape[0]} labels")
    return problems
