"""The `blind` layer's halves: secagg's sum with an output mask under it, so that only silos read the sum.

A silo encodes its input in the ring as secagg does, adds its output mask (`keys`: a keystream from the
output key, which the aggregator lacks, bound to this session) and then secagg's masks. The session runs
unchanged (`privacy.secagg.halves`): the pairwise and self masks cancel or are removed at the aggregator,
dropouts are recovered as in secagg, and what the aggregator unmasks is Σ_{U3} x_u + Σ_{U3} o_u, the inputs
under every survivor's output mask: uniformly random to it. It hands that total to every silo of U4
(`BlindTotal`, waiting for no answer); each removes the output masks of U3, the survivors it signed for in
the consistency round, and decodes. A census is recomputed from the signed transcript as under secagg (the
aggregator cannot skew it), then unmasked the same way.

What a forged total buys the aggregator: the silos read the sum plus a value it chose (a model it poisons but
never sees), as under ckks. Silos that were handed different totals step to different states, and no state
is committed that not every counted silo signed (`privacy.stepping.attestation`).

The evaluation counts of the stepped state (`silo.stepping`) are one more sum, in one stage: each silo adds
to its encoded counts its output mask and a mask for each other silo of the sum, keyed by the mask seed the
two agreed in the round's contribution session (`SecAggClient.pair_key`) and bound to the stepped state, so
the aggregator, alone or with one silo, reads no silo's counts; the pair masks cancel only in the sum over
exactly those silos, and the silos read it and report it. It has no dropout recovery: a silo that reports no
state leaves the round without metrics, as under ckks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedlt.aggregation.halves import (
    AggregatorHalf,
    BadMessage,
    Peers,
    Released,
    SettingsRefused,
    Signer,
    SiloHalf,
    SumAborted,
    SumSpec,
    WrongStage,
)
from privacy.blind.keys import OutputKey, add_mask, remove_masks, sum_label
from privacy.crypto import transcript
from privacy.keyservice.relay import KeyRelay, NoKeyYet
from privacy.ring import apply_masks
from privacy.secagg.halves import (
    SecAggAggregatorHalf,
    SecAggAggregatorSide,
    SecAggSiloHalf,
    SecAggSiloSide,
    codec_of,
)
from privacy.secagg.protocol import SecAggClient
from privacy.secagg.settings import SessionPolicy

TOTAL, DONE = "total", "done"
KeyLookup = Callable[[object], OutputKey]  # a consortium silo's keyring: the key a round's parameters name


@dataclass(frozen=True)
class BlindTotal:
    """After the unmask stage, to every silo of U4: the sum over U3, still under every survivor's output mask
    (a ring vector's bytes)."""

    total: bytes = field(repr=False)


@dataclass(frozen=True)
class MaskedCounts:
    """A silo's evaluation counts under its output mask and its pair masks (a ring vector's bytes)."""

    vector: bytes = field(repr=False)


@dataclass(frozen=True)
class CountsTotal:
    """The evaluation sum, to every silo it adds up, with who that is: still under their output masks."""

    total: bytes = field(repr=False)
    silos: tuple[str, ...]


def _ring_vector(raw: bytes, nbytes: int, what: str) -> np.ndarray:
    if len(raw) != nbytes:
        raise BadMessage(f"{what} of {len(raw)} bytes; the sum's ring has {nbytes}")
    return np.frombuffer(raw, dtype=np.uint8).copy()


class BlindSiloHalf(SecAggSiloHalf):
    """A silo's half of a census or contribution: secagg's, with its output mask under secagg's masks."""

    def __init__(self, spec: SumSpec, me: str, key: OutputKey, **secagg: object) -> None:
        super().__init__(spec, me, **secagg)
        self._key = key

    @property
    def reads_sum(self) -> bool:
        return True  # every sum of this layer: the aggregator's total is masked

    def _label(self) -> bytes:
        spec = self.client.spec  # with the key list's digest once stage 0 is closed: fresh every attempt
        return sum_label(spec.round_id, spec.purpose, spec.binding, spec.keys_digest)

    def _masking(self, encoded: np.ndarray) -> np.ndarray:
        add_mask(self.codec.ring, encoded, self._key, self._label(), self.client.me)
        return encoded

    def _read(self, total: np.ndarray) -> None:
        remove_masks(self.codec.ring, total, self._key, self._label(), self.client.survivors)
        super()._read(total)

    @property
    def readers(self) -> tuple[str, ...]:
        return self.client.signers  # handed the total: a survivor lost before signing reads nothing

    def _other_step(self, step: object) -> list[object]:
        if not isinstance(step, BlindTotal):
            return super()._other_step(step)
        if self.client.spec.recomputed or not self.client.survivors or self._done:
            raise WrongStage("a blind total where this silo recomputes the sum itself, or has not signed one")
        self._read(_ring_vector(step.total, self.codec.ring.nbytes, "a blind total"))
        return []


class BlindAggregatorHalf(SecAggAggregatorHalf):
    """The aggregator's half: secagg's, which hands the unmasked total to the silos instead of reading it."""

    def __init__(self, spec: SumSpec, *, peers: Peers) -> None:
        super().__init__(spec, peers=peers)
        self._handed: bytes | None = None  # the total, once handed to the silos
        self._released_once = False

    @property
    def stage(self) -> str:
        if self._handed is None:
            return super().stage
        return DONE if self._released_once else TOTAL

    @property
    def expected(self) -> tuple[str, ...]:
        return () if self._handed is not None else super().expected

    @property
    def answered(self) -> set[str]:
        return set() if self._handed is not None else super().answered

    def close(self) -> Mapping[str, object] | Released:
        if self._handed is None:
            return super().close()
        if self._released_once:
            raise WrongStage(f"the {self.spec.purpose} sum is done: nothing to close")
        self._released_once = True
        return self._released()

    def _unmasked(self) -> Mapping[str, object]:
        self._handed = self._total.tobytes()
        return dict.fromkeys(self.server.u4, BlindTotal(self._handed))

    def _released(self) -> Released:
        # the total is masked: only silos read it, those of U4 it was handed to
        return Released(self.server.u3, None, readers=self.server.u4)

    def download(self, silo: str) -> bytes:
        if self._handed is None or silo not in self.server.u4:
            raise WrongStage(f"no blind total for {silo} (at {self.stage})")
        return self._handed


class CountsSiloHalf(SiloHalf):
    """A silo's half of the evaluation sum: one masked upload, then the total to unmask."""

    def __init__(
        self,
        spec: SumSpec,
        me: str,
        key: OutputKey,
        session: SecAggClient,
        may_release: Callable[[tuple[str, ...]], None],
    ) -> None:
        self.spec, self.me, self._key, self._session = spec, me, key, session
        self._may_release = may_release
        self.codec = codec_of(spec)
        self._label = sum_label(spec.round_id, spec.purpose, spec.binding)
        self._result: torch.Tensor | None = None

    def start(self, vector: torch.Tensor) -> list[object]:
        self._may_release(self.spec.silos)  # the masks cancel only in the sum over exactly these silos
        encoded = self.codec.encode(vector)
        add_mask(self.codec.ring, encoded, self._key, self._label, self.me)
        pair_label = transcript("fedlt/blind/evaluation-pair/v1", self._label)
        pairs = [
            (self._session.pair_key(other, pair_label), self.me < other)
            for other in self.spec.silos
            if other != self.me
        ]
        apply_masks(self.codec.ring, encoded, pairs)
        return [MaskedCounts(encoded.tobytes())]

    def step(self, step: object) -> list[object]:
        if not isinstance(step, CountsTotal) or self._result is not None:
            raise WrongStage(f"{type(step).__name__} is no step of this evaluation sum now")
        if step.silos != self.spec.silos:
            raise BadMessage("the evaluation sum adds up other silos than those whose masks cancel in it")
        total = _ring_vector(step.total, self.codec.ring.nbytes, "an evaluation total")
        remove_masks(self.codec.ring, total, self._key, self._label, self.spec.silos)
        self._result = self.codec.decode(total)
        return []

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def counted(self) -> tuple[str, ...]:
        return self.spec.silos if self._result is not None else ()

    @property
    def result(self) -> torch.Tensor | None:
        return self._result


class CountsAggregatorHalf(AggregatorHalf):
    """The aggregator's half of the evaluation sum: add the masked uploads, hand the total back."""

    def __init__(self, spec: SumSpec) -> None:
        self.spec = spec
        self._ring = codec_of(spec).ring
        self._uploads: dict[str, bytes] = {}
        self._stage = "upload"

    @property
    def stage(self) -> str:
        return self._stage

    @property
    def expected(self) -> tuple[str, ...]:
        return self.spec.silos if self._stage == "upload" else ()

    @property
    def answered(self) -> set[str]:
        return set(self._uploads) if self._stage == "upload" else set()

    def receive(self, silo: str, message: object) -> None:
        if self._stage != "upload" or silo not in self.spec.silos or not isinstance(message, MaskedCounts):
            raise WrongStage(f"{silo} may not send a {type(message).__name__} to this sum now")
        _ring_vector(message.vector, self._ring.nbytes, f"{silo}'s masked counts")
        if self._uploads.setdefault(silo, message.vector) != message.vector:
            raise BadMessage(f"{silo} already sent other masked counts")

    def close(self) -> Mapping[str, object] | Released:
        if self._stage == "upload":
            silent = sorted(set(self.spec.silos) - set(self._uploads))
            if silent:
                raise SumAborted(f"{', '.join(silent)} sent no counts: the others' masks cannot cancel")
            total = self._ring.zeros()
            for silo in self.spec.silos:
                self._ring.add(total, np.frombuffer(self._uploads[silo], dtype=np.uint8))
            self._stage = TOTAL
            return dict.fromkeys(self.spec.silos, CountsTotal(total.tobytes(), self.spec.silos))
        if self._stage == TOTAL:
            self._stage = DONE
            return Released(self.spec.silos, None)
        raise WrongStage("the evaluation sum is done: nothing to close")

    def upload_bytes(self, silo: str, kind: type) -> int:
        if kind is not MaskedCounts or self._stage != "upload":
            raise WrongStage(f"this sum takes masked counts at its upload stage, not a {kind.__name__}")
        return self._ring.nbytes + 256  # the bytes and the generic codec's framing


class BlindSiloSide(SecAggSiloSide):
    """`key_for(settings)` is the output key a round's signed parameters name (SettingsRefused if this silo
    does not hold it); the simulator has one for the run. The side keeps the round's contribution session,
    whose pair seeds mask the evaluation counts of the state stepped from it."""

    steps_model = True

    def __init__(
        self, key_for: KeyLookup, *, sign: Signer, peers: Peers, policy: SessionPolicy | None = None
    ) -> None:
        super().__init__(sign=sign, peers=peers, policy=policy)
        self.key_for = key_for
        self._session: tuple[str, SecAggClient] | None = None  # (round id, its contribution's client)

    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        key = self.key_for(spec.settings)
        if spec.purpose == "evaluation":
            if self._session is None or self._session[0] != spec.round_id:
                raise SumAborted(f"no contribution session of {spec.round_id} to mask its evaluation with")
            return CountsSiloHalf(spec, me, key, self._session[1], may_release)
        half = BlindSiloHalf(
            spec, me, key, sign=self.sign, peers=self.peers, policy=self.policy, may_release=may_release
        )
        if spec.purpose == "contribution":
            self._session = (spec.round_id, half.client)
        return half

    def problems(self, spec: SumSpec) -> list[str]:
        try:
            self.key_for(spec.settings)
        except SettingsRefused as exc:
            return [str(exc)]
        return super().problems(spec)


class BlindAggregatorSide(SecAggAggregatorSide):
    """`keys`, in a consortium, is the key service's relay: the aggregator holds nothing of the key, but
    names in each RoundSpec the key every silo must mask with, and invites only silos the key reached."""

    def __init__(self, *, peers: Peers, keys: KeyRelay | None = None) -> None:
        super().__init__(peers=peers)
        self.keys = keys

    def half(self, spec: SumSpec) -> AggregatorHalf:
        if spec.purpose == "evaluation":
            return CountsAggregatorHalf(spec)
        return BlindAggregatorHalf(spec, peers=self.peers)

    def eligible(self, silo: str) -> bool:
        return self.keys is None or self.keys.eligible(silo)

    def round_settings(self, settings: object) -> object:
        if self.keys is None:
            return settings
        if self.keys.public is None:
            raise NoKeyYet("the key holder has not shared the consortium's output key yet")
        return replace(settings, context_id=self.keys.context_id, key_holder=self.keys.key_holder)
