"""The `ckks` layer's two halves: silos encrypt, the aggregator adds ciphertexts, silos decrypt the sum.

Stages at the aggregator: `upload` (one `EncryptedUpload` per silo, added to the running ciphertext sum as it
arrives), then `delivered` (every silo summed gets the `EncryptedSum` and who it counts), then released, with
no plaintext: the aggregator never holds a key that decrypts. A silo decrypts the sum only if `may_release`
allows a sum over those silos (the round driver's whole-census check and the silo's ledger), and rounds each
field to its fixed-point grid (`Field.frac_bits`, as the secure layer's codec does), so every silo, decrypting
the same ciphertext with the same key, holds the same numbers to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    BadMessage,
    Released,
    SettingsRefused,
    SiloHalf,
    SiloSide,
    SumSpec,
    WrongStage,
)
from privacy.ckks.keys import CkksKeyError, PublicContext, SecretContext, ciphertext_limit, scale_bits
from privacy.ckks.relay import CkksRelay, NoKeyYet
from privacy.ckks.settings import CkksParameters

UPLOAD, DELIVERED, DONE = "upload", "delivered", "done"


@dataclass(frozen=True)
class EncryptedUpload:
    """One silo's vector, encrypted under the consortium's key."""

    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class EncryptedSum:
    """The ciphertext sum, to every silo it counts, with who that is."""

    blob: bytes = field(repr=False)
    survivors: tuple[str, ...]


def on_grid(spec: SumSpec, values: np.ndarray) -> torch.Tensor:
    """Each field rounded to multiples of 2^-frac_bits: CKKS is approximate, the consortium's state is not."""
    grids = np.concatenate([np.full(f.size, 2.0**f.frac_bits) for f in spec.schema.fields])
    return torch.from_numpy(np.round(values * grids) / grids)


class CkksSiloHalf(SiloHalf):
    def __init__(
        self, spec: SumSpec, secret: SecretContext, may_release: Callable[[tuple[str, ...]], None]
    ) -> None:
        self.spec, self._secret, self._may_release = spec, secret, may_release
        self._scale = scale_bits(spec.schema, len(spec.silos))  # refuses a range that could overflow
        self._counted: tuple[str, ...] = ()
        self._result: torch.Tensor | None = None

    def start(self, vector: torch.Tensor) -> list[object]:
        clipped = vector.to(torch.float64).numpy()
        return [EncryptedUpload(self._secret.encrypt(clipped, scale_bits=self._scale))]

    def step(self, step: object) -> list[object]:
        if not isinstance(step, EncryptedSum):
            raise WrongStage(f"{type(step).__name__} is no step of a CKKS sum")
        if not set(step.survivors) <= set(self.spec.silos):
            raise BadMessage("the encrypted sum counts silos outside this sum")
        self._may_release(step.survivors)
        try:
            values = self._secret.decrypt(step.blob, self.spec.schema.size)
        except CkksKeyError as exc:
            raise BadMessage(f"the encrypted sum: {exc}") from None
        self._counted, self._result = step.survivors, on_grid(self.spec, values)
        return []

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def counted(self) -> tuple[str, ...]:
        return self._counted

    @property
    def result(self) -> torch.Tensor | None:
        return self._result


class CkksAggregatorHalf(AggregatorHalf):
    def __init__(self, spec: SumSpec, public: PublicContext) -> None:
        self.spec, self._public = spec, public
        self._uploads: dict[str, bytes] = {}
        self._total = None
        self._stage = UPLOAD
        self._survivors: tuple[str, ...] = ()
        self.summed = b""  # the encrypted sum, for silos to download

    @property
    def stage(self) -> str:
        return self._stage

    @property
    def expected(self) -> tuple[str, ...]:
        return self.spec.silos if self._stage == UPLOAD else ()

    @property
    def answered(self) -> set[str]:
        return set(self._uploads) if self._stage == UPLOAD else set()

    @property
    def counted(self) -> tuple[str, ...] | None:
        return self._survivors or None

    def receive(self, silo: str, message: object) -> None:
        if self._stage != UPLOAD or silo not in self.spec.silos:
            raise WrongStage(f"{silo} may not upload to this sum now ({self._stage})")
        if not isinstance(message, EncryptedUpload):
            raise WrongStage(f"a CKKS sum takes encrypted uploads, not {type(message).__name__}")
        if silo in self._uploads:
            if self._uploads[silo] != message.blob:
                raise BadMessage(f"{silo} already uploaded another ciphertext")
            return
        try:
            ciphertext = self._public.read(message.blob)
        except CkksKeyError as exc:
            raise BadMessage(f"{silo}'s upload: {exc}") from None
        if ciphertext.size() != self.spec.schema.size:
            raise BadMessage(
                f"a ciphertext of {ciphertext.size()} values; the schema has {self.spec.schema.size}"
            )
        self._total = ciphertext if self._total is None else self._total.add(ciphertext)
        self._uploads[silo] = message.blob

    def close(self) -> Mapping[str, object] | Released:
        if self._stage == UPLOAD:
            self._survivors = tuple(u for u in self.spec.silos if u in self._uploads)
            if not self._survivors:
                raise WrongStage("no silo uploaded to this sum")
            self.summed = self._total.serialize()
            self._stage = DELIVERED
            step = EncryptedSum(self.summed, self._survivors)
            return dict.fromkeys(self._survivors, step)
        self._stage = DONE
        return Released(self._survivors, None)

    def upload_bytes(self, silo: str, kind: type) -> int:
        if kind is not EncryptedUpload or self._stage != UPLOAD:
            raise WrongStage(f"this sum takes encrypted uploads at its upload stage, not a {kind.__name__}")
        return ciphertext_limit(self.spec.schema.size)

    def download(self, silo: str) -> bytes:
        if self._stage == UPLOAD or silo not in self._survivors:
            raise WrongStage(f"no encrypted sum for {silo} (at {self._stage})")
        return self.summed


class CkksSiloSide(SiloSide):
    """`secret_for(settings)` is the secret context a round's signed parameters name (SettingsRefused if this
    silo does not hold it); the simulator has one for the whole run."""

    steps_model = True

    def __init__(self, secret_for: Callable[[object], SecretContext]) -> None:
        self.secret_for = secret_for

    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        return CkksSiloHalf(spec, self.secret_for(spec.settings), may_release)

    def problems(self, spec: SumSpec) -> list[str]:
        try:
            self.secret_for(spec.settings)
            scale_bits(spec.schema, len(spec.silos))
        except SettingsRefused as exc:
            return [str(exc)]
        return []


class CkksAggregatorSide(AggregatorSide):
    """`keys` is the public context, or (a consortium) the key ceremony's relay, which receives it later."""

    def __init__(self, keys: PublicContext | CkksRelay) -> None:
        self.keys = keys

    def half(self, spec: SumSpec) -> AggregatorHalf:
        public = self.keys if isinstance(self.keys, PublicContext) else self.keys.public
        if public is None:
            raise NoKeyYet("the key holder has not shared the consortium's CKKS key yet")
        return CkksAggregatorHalf(spec, public)

    def eligible(self, silo: str) -> bool:
        return isinstance(self.keys, PublicContext) or self.keys.eligible(silo)

    def round_settings(self, settings: object) -> object:
        if isinstance(self.keys, PublicContext):
            return settings
        return CkksParameters(settings.k_min, self.keys.context_id, self.keys.key_holder)
