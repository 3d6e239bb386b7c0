"""Schemas, contributions, sums, and the table of privacy layers that produce sums.

Layers are listed by import path so `fedlt` never imports the `privacy` package that implements the secure
ones (imports point one way: fedlt ← privacy); the path is resolved only when a layer is asked for by name.
"""

from __future__ import annotations

import importlib

from fedlt.aggregation.schema import Contribution, Field, Schema
from fedlt.aggregation.sums import SumLayer, Sums
from fedlt.errors import ConfigError

LAYERS: dict[str, str] = {
    "plaintext": "fedlt.aggregation.plaintext:PlaintextSum",
    "secagg": "privacy.secagg.layer:SecAggSum",
    "ckks": "privacy.ckks.layer:CkksSum",
}


def layer_class(name: str) -> type[SumLayer]:
    """The class of the layer `name` from the table, for what it declares before any settings."""
    if name not in LAYERS:
        raise ConfigError("privacy", [f"unknown privacy layer {name!r}; allowed: {', '.join(LAYERS)}"])
    module, _, attr = LAYERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_layer(name: str, settings: object | None = None) -> SumLayer:
    """The layer `name` from the table, with its own settings section (its defaults when None)."""
    cls = layer_class(name)
    return cls() if settings is None else cls(settings)


__all__ = ["LAYERS", "Contribution", "Field", "Schema", "SumLayer", "Sums", "layer_class", "make_layer"]
