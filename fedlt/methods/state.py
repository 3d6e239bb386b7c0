"""The global state a method's server half owns: the model plus any persistent server-side tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fedlt import tensorpack


@dataclass(frozen=True)
class GlobalState:
    """`round` counts completed rounds; `extra` holds method tensors that persist across rounds
    (CReFF's federated features, RedGrape's prototypes), never per-silo values."""

    round: int
    model: Mapping[str, torch.Tensor]
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def digest(self) -> str:
        """SHA-256 over names, dtypes, shapes and bytes: what silos verify and sign before a round.

        Computed once per state (states are never modified in place: every step makes a new one)."""
        if "_digest" not in self.__dict__:
            object.__setattr__(self, "_digest", self._compute_digest())
        return self.__dict__["_digest"]

    def content_digest(self) -> str:
        """SHA-256 over the tensors alone, without the round number: what a silo trains from, whatever round
        the aggregator labels it with (the release gate keys a silo's contribution by it)."""
        if "_content" not in self.__dict__:
            object.__setattr__(self, "_content", self._hash(hashlib.sha256(b"fedlt/state-content/v1")))
        return self.__dict__["_content"]

    def _compute_digest(self) -> str:
        return self._hash(hashlib.sha256(f"round={self.round}".encode()))

    def _hash(self, h: hashlib._Hash) -> str:
        for group, tensors in (("model", self.model), ("extra", self.extra)):
            for name in sorted(tensors):
                t = tensors[name].detach().contiguous().cpu()
                h.update(f"\x1f{group}/{name}:{t.dtype}:{tuple(t.shape)}\x1f".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def float_keys(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Entries that are averaged: parameters and float buffers (BatchNorm statistics), not step counters."""
    return [k for k, v in state_dict.items() if v.is_floating_point()]


def flatten(state_dict: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([state_dict[k].detach().reshape(-1) for k in keys])


def unflatten(
    vector: torch.Tensor, template: Mapping[str, torch.Tensor], keys: list[str]
) -> dict[str, torch.Tensor]:
    """`template` with `keys` replaced by consecutive slices of `vector` (cast to each entry's dtype)."""
    out = {k: v.clone() for k, v in template.items()}
    offset = 0
    for k in keys:
        n = out[k].numel()
        out[k] = vector[offset : offset + n].reshape(out[k].shape).to(out[k].dtype)
        offset += n
    return out


def pack_state(state: GlobalState) -> bytes:
    """The state as pickle-free bytes (fedlt.tensorpack), for the wire and for storage."""
    tensors = {f"model/{k}": v for k, v in state.model.items()}
    tensors.update({f"extra/{k}": v for k, v in state.extra.items()})
    return tensorpack.pack(tensors)


def unpack_state(data: bytes, round_number: int) -> GlobalState:
    model: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    for name, tensor in tensorpack.unpack(data).items():
        group, _, key = name.partition("/")
        if group not in ("model", "extra") or not key:
            raise tensorpack.PackError(f"unexpected tensor {name!r} in a packed state")
        (model if group == "model" else extra)[key] = tensor
    return GlobalState(round_number, model, extra)
