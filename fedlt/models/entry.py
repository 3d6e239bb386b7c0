"""Models named by entry point, `package.module:factory`: how a plan names one, the options it passes, and
how the factory's network becomes a SplitModel.

The factory's contract (docs/bring-your-own.md): fedlt calls `factory(num_classes=C, **options)`, adding
`input_shape` (one sample's shape: `(channels, height, width)` of an image, `(features,)` of an encoded table
row) only when the factory names a parameter `input_shape`, and, for images, `image_shape` only when it names
`image_shape` (never through `**kwargs`, which torchvision's builders forward to the network's constructor),
under fedlt's seed as a built-in is built. It returns a `torch.nn.Module` that is
- a SplitModel, used as it is;
- a module with an `encoder` module and a `classifier` nn.Linear, whose forward is classifier(encoder(x));
- or a module whose last child, followed through last children, is an nn.Linear (torchvision's ResNet `fc`,
  an nn.Sequential's last layer, MONAI's DenseNet `class_layers.out`): that layer becomes the classifier and
  nn.Identity takes its place in the encoder.
The split is checked on one seeded batch of the plan's image shape in eval mode: it must compute what the
network computes, so a network whose last registered child is not its output layer is refused, not split
wrongly.

Parsing here never imports: only `build_entry` does, which a silo reaches once its policy allowed the entry
point and its pinned digest matched (`silo.models`).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import keyword
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedlt.errors import ConfigError
from fedlt.models.base import SplitModel

_ENTRY = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<factory>[A-Za-z_]\w*)", re.ASCII)
ENTRY_FORM = "'package.module:factory'"
# set by fedlt from the plan, never by `[model] options`
RESERVED_OPTIONS = ("num_classes", "image_shape", "input_shape")


@dataclass(frozen=True)
class EntryPoint:
    module: str
    factory: str

    @property
    def top_level(self) -> str:
        """The installed package or module whose source a silo pins (`silo.models.source_digest`)."""
        return self.module.partition(".")[0]

    def __str__(self) -> str:
        return f"{self.module}:{self.factory}"


def parse_entry(text: str) -> EntryPoint | None:
    """`text` as an entry point, or None where it is not one (dotted Python names, one colon, ASCII)."""
    match = _ENTRY.fullmatch(text)
    if match is None or any(keyword.iskeyword(part) for part in re.split(r"[.:]", text)):
        return None
    return EntryPoint(match["module"], match["factory"])


Scalar = str | int | float | bool


@dataclass(frozen=True)
class ModelOptions:
    """`[model] options`: keyword arguments for an entry point's factory, as plain TOML values (strings,
    numbers, booleans, arrays of them), so that the signed plan's text says exactly what every silo builds.
    Kept sorted by name, as tuples, so that a plan hashes and compares as a value."""

    items: tuple[tuple[str, Scalar | tuple[Scalar, ...]], ...] = ()

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str, problems: list[str]) -> ModelOptions:
        items = []
        for name, value in table.items():
            problem = _option_problem(name, value)
            if problem:
                problems.append(f"{where}.{name}: {problem}")
            else:
                items.append((name, tuple(value) if isinstance(value, list) else value))
        return cls(tuple(sorted(items)))

    def to_table(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in self.items}

    def __bool__(self) -> bool:
        return bool(self.items)


def _option_problem(name: str, value: Any) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        return "not a Python keyword-argument name"
    if name in RESERVED_OPTIONS:
        return "set by fedlt from the plan (model.classes, the input shape), not an option"
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        return "arrays of arrays are not plain values; pass a flat array"
    odd = next((v for v in values if not isinstance(v, Scalar)), None)
    if odd is not None:
        kind = "a table" if isinstance(odd, Mapping) else type(odd).__name__
        if isinstance(odd, datetime.date | datetime.time):
            kind = "a date or time"
        return f"expected a string, number, boolean or an array of them, got {kind}"
    return ""


def build_entry(
    entry: EntryPoint, *, input_shape: tuple[int, ...], num_classes: int, options: ModelOptions
) -> SplitModel:
    """The factory's network as a SplitModel; the caller seeds torch's generator (`fedlt.models.build_model`).
    Every failure of the user's code is a ConfigError naming the entry point."""
    factory = _factory(entry)
    kwargs: dict[str, Any] = {"num_classes": num_classes, **options.to_table()}
    if _names_parameter(factory, "input_shape"):
        kwargs["input_shape"] = input_shape
    if len(input_shape) == 3 and _names_parameter(factory, "image_shape"):
        kwargs["image_shape"] = input_shape
    try:
        network = factory(**kwargs)
    except Exception as exc:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise _error(f"{entry}({args}) failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(network, nn.Module):
        raise _error(f"{entry} returned a {type(network).__name__}, not a torch.nn.Module")
    reference = _outputs(network, input_shape, entry)
    model = split(network, entry)
    if model.num_classes != num_classes:
        raise _error(
            f"{entry}'s classifier has {model.num_classes} outputs, but the plan has {num_classes} classes",
        )
    if not torch.allclose(_outputs(model, input_shape, entry), reference, rtol=1e-5, atol=1e-6):
        raise _error(
            f"{entry}'s output is not classifier(encoder(x)) of its split: declare `encoder` and "
            "`classifier` that compose to its forward, or make its output layer its last child",
        )
    return model


def split(network: nn.Module, entry: EntryPoint | str) -> SplitModel:
    """`network`'s encoder/classifier split, as the module docstring says; refuses a network without one."""
    if isinstance(network, SplitModel):
        return network
    encoder = getattr(network, "encoder", None)
    classifier = getattr(network, "classifier", None)
    if isinstance(encoder, nn.Module) and classifier is not None:
        if not isinstance(classifier, nn.Linear):
            raise _error(
                f"{entry} declares a classifier that is a {type(classifier).__name__}, not an nn.Linear"
            )
        return SplitModel.adopt(encoder, classifier)
    found = _last_linear(network)
    if found is None:
        raise _error(
            f"{entry} has no encoder/classifier split: declare `encoder` and `classifier` (an nn.Linear), "
            "or end in an nn.Linear",
        )
    parent, name, linear = found
    setattr(parent, name, nn.Identity())
    return SplitModel.adopt(network, linear)


def _last_linear(network: nn.Module) -> tuple[nn.Module, str, nn.Linear] | None:
    """The last child of `network`, of its last child and so on down to a leaf, with its parent and name,
    where that leaf is an nn.Linear."""
    parent, name, node = None, "", network
    while children := list(node.named_children()):
        parent, (name, node) = node, children[-1]
    if parent is None or not isinstance(node, nn.Linear):
        return None
    return parent, name, node


def _factory(entry: EntryPoint) -> Callable[..., Any]:
    try:
        module = importlib.import_module(entry.module)
    except Exception as exc:
        raise _error(f"{entry}: importing {entry.module} failed: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, entry.factory, None)
    if not callable(factory):
        raise _error(f"{entry}: {entry.module} has no function or class {entry.factory!r}")
    return factory


def _names_parameter(factory: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a readable signature takes only what it is given
        return False


def _outputs(model: nn.Module, input_shape: tuple[int, ...], entry: EntryPoint | str) -> torch.Tensor:
    """`model` on a seeded batch of two, in eval mode and without gradients, so that neither the model's
    buffers (BatchNorm's running statistics) nor torch's global generator change."""
    x = torch.randn((2, *input_shape), generator=torch.Generator().manual_seed(0))
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    except Exception as exc:
        raise _error(
            f"{entry} failed on a batch of {list(input_shape)} inputs: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for m, training in modes.items():
            m.training = training


def _error(problem: str) -> ConfigError:
    return ConfigError("model.name", [problem])
