"""The table of federated methods a configuration may name."""

from __future__ import annotations

from fedlt.errors import ConfigError
from fedlt.methods.base import Method, ModelSpec, ServerContext, SiloContext
from fedlt.methods.choice import METHODS, MethodChoice
from fedlt.methods.local import TrainConfig
from fedlt.methods.state import GlobalState


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError("method.name", [f"unknown method {name!r}; allowed: {', '.join(METHODS)}"])
    return METHODS[name]


__all__ = [
    "METHODS",
    "GlobalState",
    "Method",
    "MethodChoice",
    "ModelSpec",
    "ServerContext",
    "SiloContext",
    "TrainConfig",
    "method_class",
]
