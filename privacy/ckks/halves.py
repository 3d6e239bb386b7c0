"""The `ckks` layer's two halves: silos encrypt, the aggregator adds ciphertexts, silos agree on the sum and
decrypt it.

Stages at the aggregator: `upload` (one `EncryptedUpload` per silo, added to the running ciphertext sum as it
arrives), `sign` (every silo summed gets the `EncryptedSum` and who it counts, and answers with its signature
over them), then `delivered` (every survivor gets every survivor's signature, `SumSignatures`), then released,
with no plaintext: the aggregator never holds a key that decrypts.

The consistency step exists because the aggregator chooses what each silo decrypts: its public context can
neither decrypt nor encrypt afresh, but it adds a plaintext of its choosing to any ciphertext (TenSEAL's
add-plain needs no secret key), so it could hand one silo the true sum and the others the sum plus a chosen P,
and have them step to different models. A silo therefore signs, with its consortium certificate key, the
SHA-256 of the ciphertext it was handed and the survivor list, bound to the sum's round id, purpose and
binding; and it decrypts only once it holds a valid signature of every silo of that list over exactly what it
was handed itself. Any missing, invalid or disagreeing signature ends the sum for it, with nothing decrypted.
Then, and only then, it asks `may_release` (the round driver's whole-census check and the silo's gate and
ledger): under ckks a sum's inputs become readable where a silo decrypts it, as every silo holds the key, so
that is this silo's release; signing releases nothing, and a silo that never gets every signature pins no
survivor set (the aggregator likewise settles `counted` only once every survivor signed). Every silo then
decrypts the same ciphertext with the same key and rounds each field to its fixed-point grid
(`Field.frac_bits`, as the secure layer's codec does), so all hold the same numbers to the bit.

What the step does not stop: the aggregator may hand every silo the same `E + P`. All sign the same hash, all
decrypt the same numbers and step to the same model, so no silo's input is read apart from the others'; it is
an attack on the model's integrity (as an aggregator's model is under secagg), not a read of one silo.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    BadMessage,
    Peers,
    Released,
    SettingsRefused,
    Signer,
    SiloHalf,
    SiloSide,
    SumAborted,
    SumSpec,
    WrongStage,
)
from fedlt.errors import FedltError
from privacy.ckks.keys import CkksKeyError, PublicContext, SecretContext, ciphertext_limit, scale_bits
from privacy.ckks.settings import CkksParameters
from privacy.crypto import transcript
from privacy.keyservice.relay import KeyRelay, NoKeyYet
from privacy.peers import ConsistencySignature, Signed

UPLOAD, SIGN, DELIVERED, DONE = "upload", "sign", "delivered", "done"
CONSISTENCY_CONTEXT = "fedlt/ckks/consistency/v1"


class SumNotAgreed(BadMessage):
    """Signatures that do not show every survivor was handed the same ciphertext sum: nothing is decrypted."""


@dataclass(frozen=True)
class EncryptedUpload:
    """One silo's vector, encrypted under the consortium's key, its ciphertexts seeded
    (`privacy.ckks.seeded`): the aggregator refuses one announcing more bytes than that form needs
    (`ciphertext_limit`)."""

    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class EncryptedSum:
    """The ciphertext sum, to every silo it counts, with who that is: expanded, twice an upload's bytes."""

    blob: bytes = field(repr=False)
    survivors: tuple[str, ...]


@dataclass(frozen=True)
class SumSignatures:
    """After every survivor signed: all of their signatures, to every survivor."""

    by_silo: Mapping[str, Signed]


def consistency_message(spec: SumSpec, sha256: bytes, survivors: tuple[str, ...]) -> bytes:
    """What each survivor signs: the sum (round id, purpose, binding), the ciphertext hash, whom it counts."""
    return transcript("fedlt/ckks/sum/v1", spec.round_id, spec.purpose, spec.binding, sha256, *survivors)


def on_grid(spec: SumSpec, values: np.ndarray) -> torch.Tensor:
    """Each field rounded to multiples of 2^-frac_bits: CKKS is approximate, the consortium's state is not."""
    grids = np.concatenate([np.full(f.size, 2.0**f.frac_bits) for f in spec.schema.fields])
    return torch.from_numpy(np.round(values * grids) / grids)


class CkksSiloHalf(SiloHalf):
    def __init__(
        self,
        spec: SumSpec,
        me: str,
        secret: SecretContext,
        *,
        sign: Signer,
        peers: Peers,
        may_release: Callable[[tuple[str, ...]], None],
    ) -> None:
        self.spec, self.me, self._secret = spec, me, secret
        self._sign, self._peers, self._may_release = sign, peers, may_release
        self._scale = scale_bits(spec.schema, len(spec.silos))  # refuses a range that could overflow
        self._handed: EncryptedSum | None = None
        self._signed = b""  # the consistency message this silo signed
        self._refused = False  # signatures that did not agree: this silo decrypts nothing of this sum
        self._result: torch.Tensor | None = None

    def start(self, vector: torch.Tensor) -> list[object]:
        clipped = vector.to(torch.float64).numpy()
        return [EncryptedUpload(self._secret.encrypt(clipped, scale_bits=self._scale))]

    def step(self, step: object) -> list[object]:
        if isinstance(step, EncryptedSum):
            return [self._consistency(step)]
        if isinstance(step, SumSignatures):
            self._decrypt(step)
            return []
        raise WrongStage(f"{type(step).__name__} is no step of a CKKS sum")

    def _consistency(self, step: EncryptedSum) -> ConsistencySignature:
        """Sign what this silo was handed: the ciphertext's hash and the survivors it names."""
        if self._handed is not None:
            raise WrongStage("a second encrypted sum for a sum this silo already signed")
        survivors = step.survivors
        if survivors != tuple(sorted(set(survivors))) or not set(survivors) <= set(self.spec.silos):
            raise BadMessage("the encrypted sum counts silos outside this sum, or lists them out of order")
        if self.me not in survivors:
            raise BadMessage(f"the encrypted sum does not count {self.me}, whose upload it was sent for")
        self._handed = step
        self._signed = consistency_message(self.spec, hashlib.sha256(step.blob).digest(), survivors)
        return ConsistencySignature(self._sign(self._signed, context=CONSISTENCY_CONTEXT))

    def _decrypt(self, step: SumSignatures) -> None:
        """Decrypt only with a valid signature of every survivor over exactly what this silo signed, and once
        the release check allows a sum over those survivors."""
        if self._handed is None or self._result is not None or self._refused:
            raise WrongStage("consistency signatures arrived where no signed sum waits for them")
        try:
            self._check(step.by_silo)
        except SumNotAgreed:
            self._refused = True
            raise
        self._may_release(self._handed.survivors)
        try:
            values = self._secret.decrypt(self._handed.blob, self.spec.schema.size)
        except CkksKeyError as exc:
            raise BadMessage(f"the encrypted sum: {exc}") from None
        self._result = on_grid(self.spec, values)

    def _check(self, by_silo: Mapping[str, Signed]) -> None:
        survivors = self._handed.survivors
        if set(by_silo) != set(survivors):
            missing = sorted(set(survivors) - set(by_silo))
            strangers = sorted(set(by_silo) - set(survivors))
            raise SumNotAgreed(
                f"signatures missing from {', '.join(missing) or 'none'}, or from silos the sum does not "
                f"count: {', '.join(strangers) or 'none'}; nothing decrypted"
            )
        for silo in survivors:
            signed = by_silo[silo]
            try:
                self._peers.verify(
                    silo, signed.certificate, signed.signature, self._signed, context=CONSISTENCY_CONTEXT
                )
            except FedltError as exc:
                raise SumNotAgreed(
                    f"{silo} signed another sum, survivor list or round than this silo was handed ({exc}); "
                    "nothing decrypted"
                ) from None

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def counted(self) -> tuple[str, ...]:
        return self._handed.survivors if self._result is not None else ()

    @property
    def result(self) -> torch.Tensor | None:
        return self._result


class CkksAggregatorHalf(AggregatorHalf):
    """`certificate(silo)` is the certificate a silo enrolled with, relayed beside its signature for peers to
    check (b"" where peers are known by bare keys). The aggregator checks no signature: every silo checks
    all of them, and refuses to decrypt if one fails."""

    def __init__(self, spec: SumSpec, public: PublicContext, certificate: Callable[[str], bytes]) -> None:
        self.spec, self._public, self._certificate = spec, public, certificate
        self._uploads: dict[str, bytes] = {}
        self._signatures: dict[str, bytes] = {}
        self._total = None
        self._stage = UPLOAD
        self._survivors: tuple[str, ...] = ()
        self.summed = b""  # the encrypted sum, for silos to download

    @property
    def stage(self) -> str:
        return self._stage

    @property
    def expected(self) -> tuple[str, ...]:
        return {UPLOAD: self.spec.silos, SIGN: self._survivors}.get(self._stage, ())

    @property
    def answered(self) -> set[str]:
        return {UPLOAD: set(self._uploads), SIGN: set(self._signatures)}.get(self._stage, set())

    @property
    def counted(self) -> tuple[str, ...] | None:
        """Settled once every survivor signed: where the signatures go out, silos may decrypt (and pin it)."""
        return self._survivors if self._stage in (DELIVERED, DONE) else None

    def receive(self, silo: str, message: object) -> None:
        if self._stage == SIGN and isinstance(message, ConsistencySignature):
            self._signature(silo, message.signature)
            return
        if self._stage != UPLOAD or silo not in self.spec.silos:
            raise WrongStage(f"{silo} may not upload to this sum now ({self._stage})")
        if not isinstance(message, EncryptedUpload):
            raise WrongStage(f"a CKKS sum takes encrypted uploads, not {type(message).__name__}")
        if silo in self._uploads:
            if self._uploads[silo] != message.blob:
                raise BadMessage(f"{silo} already uploaded another ciphertext")
            return
        limit = ciphertext_limit(self.spec.schema.size)
        if len(message.blob) > limit:  # an evaluation upload comes inside a state report, unannounced
            raise BadMessage(
                f"{silo}'s upload takes {len(message.blob)} bytes; seeded ciphertexts of this sum take at "
                f"most {limit}"
            )
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

    def _signature(self, silo: str, signature: bytes) -> None:
        if silo not in self._survivors:
            raise WrongStage(f"{silo} is not counted by this sum, so it signs nothing")
        if self._signatures.setdefault(silo, signature) != signature:
            raise BadMessage(f"{silo} already sent another consistency signature")

    def close(self) -> Mapping[str, object] | Released:
        if self._stage == UPLOAD:
            self._survivors = tuple(u for u in self.spec.silos if u in self._uploads)
            if not self._survivors:
                raise WrongStage("no silo uploaded to this sum")
            self.summed = self._total.serialize()
            self._total, self._stage = None, SIGN
            step = EncryptedSum(self.summed, self._survivors)
            return dict.fromkeys(self._survivors, step)
        if self._stage == SIGN:
            silent = sorted(set(self._survivors) - set(self._signatures))
            if silent:
                raise SumAborted(
                    f"{', '.join(silent)} did not sign the encrypted sum: no silo may decrypt it"
                )
            self._stage = DELIVERED
            signatures = SumSignatures(
                {u: Signed(self._signatures[u], self._certificate(u)) for u in self._survivors}
            )
            return dict.fromkeys(self._survivors, signatures)
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
    silo does not hold it); the simulator has one for the whole run. `sign` (the silo's certificate key) and
    `peers` (who checks other silos' signatures against the roster) sign and check the consistency step and
    the state attestations (`privacy.stepping.attestation`)."""

    steps_model = True

    def __init__(
        self,
        secret_for: Callable[[object], SecretContext],
        *,
        sign: Signer | None,
        peers: Peers | None,
    ) -> None:
        self.secret_for, self.sign, self.peers = secret_for, sign, peers

    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        if self.sign is None or self.peers is None:
            raise ValueError("a silo takes part in CKKS sums only with its signing key and its peers' check")
        secret = self.secret_for(spec.settings)
        return CkksSiloHalf(spec, me, secret, sign=self.sign, peers=self.peers, may_release=may_release)

    def problems(self, spec: SumSpec) -> list[str]:
        try:
            self.secret_for(spec.settings)
            scale_bits(spec.schema, len(spec.silos))
        except SettingsRefused as exc:
            return [str(exc)]
        return []


class CkksAggregatorSide(AggregatorSide):
    """`keys` is the public context, or (a consortium) the key service's relay, which receives it later and
    keeps the certificate each silo enrolled with (relayed beside its consistency signatures)."""

    def __init__(self, keys: PublicContext | KeyRelay) -> None:
        self.keys = keys

    def half(self, spec: SumSpec) -> AggregatorHalf:
        if isinstance(self.keys, PublicContext):
            return CkksAggregatorHalf(spec, self.keys, lambda _: b"")
        public = self.keys.public
        if public is None:
            raise NoKeyYet("the key holder has not shared the consortium's CKKS key yet")
        return CkksAggregatorHalf(spec, public, self.keys.certificate)

    def eligible(self, silo: str) -> bool:
        return isinstance(self.keys, PublicContext) or self.keys.eligible(silo)

    def round_settings(self, settings: object) -> object:
        if isinstance(self.keys, PublicContext):
            return settings
        return CkksParameters(
            k_min=settings.k_min,
            min_records=settings.min_records,
            context_id=self.keys.context_id,
            key_holder=self.keys.key_holder,
        )
