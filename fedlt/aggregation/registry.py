"""The privacy layers: one record per layer, found through the `fedlt.privacy_layers` entry points.

A layer is one package that declares one `LayerRecord`, and one entry-point line names it (pyproject.toml for
the layers shipped here; the `entry_points.txt` of any installed distribution for others). Every table of
layers derives from the records found: the simulator's and the consortium's choices, each layer's section of
consortium.toml, its parameters in a RoundSpec, its messages on the wire, the runtime capabilities it asks
for. `fedlt` names no `privacy` module; `silo` and `aggregator` name no layer. Which layers a silo runs stays
its administrator's choice (`policy.privacy`): an installed layer its policy does not list is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Protocol

from fedlt.aggregation.sums import SumLayer
from fedlt.errors import ConfigError, FedltError
from fedlt.v1 import round_pb2

GROUP = "fedlt.privacy_layers"
DEFAULT_LAYER = "secagg"  # what a consortium and a silo's policy run unless they say otherwise


class RegistryError(FedltError):
    """The installed layers do not make a registry: a record that is not one, or a name taken twice."""


@dataclass(frozen=True)
class RoundParameters:
    """How a layer's settings go into a RoundSpec and come back out of it, in fields of its own; a layer
    without them has its settings dataclass carried by name (`RoundSpec.layer_parameters`)."""

    write: Callable[[object], dict[str, object]]
    read: Callable[[round_pb2.RoundSpec], object]


@dataclass(frozen=True)
class LayerWire:
    """A layer's messages in Protobuf forms of their own (secagg, ckks). A layer may instead declare its
    messages as dataclasses (`LayerRecord.messages`), which one generic codec carries (`fedlt.wire.codec`).

    senders: a silo's message type -> (stub, round_id, purpose, message, timeout) -> reply, its own RPC;
    step_encoders / step_decoders: an aggregator stage output <-> fields of a SumStep (by oneof name);
    uploads: a Submit stream's kind -> (message type, payload -> message); from_header: what a Submit header
    adds to an upload; fetchers: a step that announces a payload -> (stub, round_id, purpose, step, timeout)
    -> the step, downloaded; receivers: an RPC's name -> (request, silo, certificate PEM) -> message;
    drill_names: what dropout drills call a message; payloads: an upload sent inside another message ->
    (kind, bytes)."""

    senders: Mapping[type, Callable[..., object]] = field(default_factory=dict)
    step_encoders: Mapping[type, Callable[[object], dict[str, object]]] = field(default_factory=dict)
    step_decoders: Mapping[str, Callable[[object], object]] = field(default_factory=dict)
    uploads: Mapping[int, tuple[type, Callable[[bytes], object]]] = field(default_factory=dict)
    from_header: Mapping[type, Callable[[object, object], object]] = field(default_factory=dict)
    fetchers: Mapping[type, Callable[..., object]] = field(default_factory=dict)
    receivers: Mapping[str, Callable[[object, str, bytes], object]] = field(default_factory=dict)
    drill_names: Mapping[type, str] = field(default_factory=dict)
    payloads: Mapping[type, tuple[int, Callable[[object], bytes]]] = field(default_factory=dict)


class SharedSecret(Protocol):
    """A consortium key that one silo makes and the key service seals to every other silo."""

    @property
    def context_id(self) -> str: ...

    def secret_bytes(self) -> bytes: ...

    def public_bytes(self) -> bytes:
        """What the aggregator may hold of the key (b"" if nothing)."""
        ...

    def derived_key(self, purpose: bytes) -> bytes: ...


@dataclass(frozen=True)
class KeyKind:
    """The key-service capability: the runtime keeps the key on disk, runs the ceremony that seals it from
    the key holder to every other silo through the aggregator, fetches a key a round names and rotates it;
    the layer says only how its key is made and read (`from_secret_bytes` and `read_public` raise ValueError
    on bytes that are no key of its kind).

    What the runtime reads of a layer that asks for it, by attribute name: its settings name the key holder
    (`key_holder`, a silo id); its round parameters as a RoundSpec signs them name the key every silo must
    use (`context_id`) and the silo that made it (`key_holder`); its aggregator side is handed the relay
    (`PartyKeys.secret`, a `privacy.keyservice.relay.KeyRelay`) and writes those two into the parameters
    (`AggregatorSide.round_settings`); its silo side is handed a lookup from round parameters to the key
    (`PartyKeys.secret`)."""

    new: Callable[[], SharedSecret]
    from_secret_bytes: Callable[[bytes], SharedSecret]
    read_public: Callable[[bytes], object]  # at the aggregator: what `public_bytes` gave


@dataclass(frozen=True)
class LayerRecord:
    """Everything the runtime needs of one layer. `settings` is its section of consortium.toml (None: it has
    none); `key_service` asks for the key service; `layer.silos_step` (a class attribute of its SumLayer)
    says only silos read its sums, so they run the server step and sum their evaluation counts."""

    name: str
    layer: type[SumLayer]
    settings: type | None = None
    parameters: RoundParameters | None = None
    wire: LayerWire = field(default_factory=LayerWire)
    messages: tuple[type, ...] = ()  # dataclass messages on the generic codec, silo's and aggregator's
    uploads: tuple[type, ...] = ()  # those of `messages` a silo sends as a Submit stream (large ones)
    key_service: KeyKind | None = None
    # the layer's reading of a silo's [policy] section (its minimums), which its silo side is given
    policy: Callable[[object], object] | None = None

    @property
    def silos_step(self) -> bool:
        return self.layer.silos_step

    def message_types(self) -> dict[str, type]:
        """The generic codec's type names of this layer's messages: '<layer>.<Class>'."""
        return {f"{self.name}.{cls.__name__}": cls for cls in self.messages}


@cache
def layers() -> dict[str, LayerRecord]:
    """Every installed layer, by name."""
    found: dict[str, LayerRecord] = {}
    for point in entry_points(group=GROUP):
        record = point.load()
        if not isinstance(record, LayerRecord):
            raise RegistryError(f"entry point {point.name} = {point.value} is not a LayerRecord")
        if record.name != point.name:
            raise RegistryError(f"entry point {point.name} names a layer called {record.name!r}")
        if record.name in found and found[record.name] is not record:
            raise RegistryError(f"two installed layers are called {record.name!r}")
        if record.key_service is not None and not _names_its_key(record):
            raise RegistryError(
                f"layer {record.name}: its key service needs round parameters that name the key (context_id) "
                "and its holder (key_holder): give it settings or parameters with both"
            )
        if record.silos_step and record.key_service is None:
            raise RegistryError(
                f"layer {record.name}: only silos read its sums, so they seal the state they step to with a "
                "key the aggregator lacks: it needs the key service (key_service)"
            )
        found[record.name] = record
    if not found:
        raise RegistryError(
            f"no privacy layer is installed (entry points {GROUP}): install fedlt (pip install -e .)"
        )
    return dict(sorted(found.items()))


def _names_its_key(record: LayerRecord) -> bool:
    """Whether the round parameters of a layer with the key service name its key: its own parameters (the
    layer's business), or its settings carried by name, which then hold both fields."""
    if record.parameters is not None:
        return True
    return record.settings is not None and {"context_id", "key_holder"} <= set(
        getattr(record.settings, "__dataclass_fields__", ())
    )


def layer_names() -> tuple[str, ...]:
    return tuple(layers())


def record(name: str) -> LayerRecord:
    """The layer `name`, or a ConfigError naming the installed ones."""
    found = layers()
    if name not in found:
        raise ConfigError("privacy", [f"unknown privacy layer {name!r}; installed: {', '.join(found)}"])
    return found[name]
