"""Schemas, contributions, sums, and the privacy layers that produce sums (found in the registry)."""

from __future__ import annotations

from fedlt.aggregation.registry import layer_names, layers, record
from fedlt.aggregation.schema import Contribution, Field, Schema
from fedlt.aggregation.sums import SumLayer, Sums


def layer_class(name: str) -> type[SumLayer]:
    """The class of the layer `name`, for what it declares before any settings."""
    return record(name).layer


def make_layer(name: str, settings: object | None = None) -> SumLayer:
    """The layer `name`, with its own settings section (its defaults when None)."""
    cls = layer_class(name)
    return cls() if settings is None else cls(settings)


__all__ = [
    "Contribution",
    "Field",
    "Schema",
    "SumLayer",
    "Sums",
    "layer_class",
    "layer_names",
    "layers",
    "make_layer",
    "record",
]
