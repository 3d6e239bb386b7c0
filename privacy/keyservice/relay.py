"""What a layer's aggregator side reads of the key service's relay (`aggregator.key_service`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fedlt.aggregation.halves import SumAborted


class NoKeyYet(SumAborted):
    """The key holder has not shared the consortium's key (with this silo) yet."""


@runtime_checkable
class KeyRelay(Protocol):
    """The relay as a layer's aggregator side sees it: the key's public part (None until the key holder
    shares it, read by the layer's `KeyKind.read_public`), the key's id and holder, which a RoundSpec names,
    the certificate each silo enrolled with, and which silos the key has reached. Checked by its shape
    (`isinstance` against the protocol): a layer never names the runtime's class."""

    @property
    def public(self) -> object | None: ...

    @property
    def context_id(self) -> str: ...

    @property
    def key_holder(self) -> str: ...

    def certificate(self, silo: str) -> bytes:
        """The certificate `silo` enrolled with (b"" if none)."""
        ...

    def eligible(self, silo: str) -> bool:
        """Whether `silo` can take part in a sum: it holds the key (the holder), or one is sealed to it."""
        ...
