"""The `secagg` layer's two halves: `protocol`'s client and server behind the layer interface
(`fedlt.aggregation.halves`), with the fixed-point codec and, at the silo, the silo's policy.

A silo half advertises keys on `start`, then answers each stage's output with its next message; before its
consistency signature it asks `may_release` (the round driver's whole-census check and the silo's ledger). The
aggregator half routes each message to the server's stage and turns each `close_*` into what goes to every
silo next; the last one releases the decoded sum of U3.

A census is a sum silos recompute (`protocol.RECOMPUTED`): after the unmask stage the aggregator half sends
every silo of U4 the signed transcript and waits for no one; each silo half recomputes the sum from it and
exposes it as `result`, which the round driver uses instead of the count the aggregator reports. A silo half
asked for a census's `result` before it has recomputed one (the aggregator sent the count and withheld the
transcript) refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    Peers,
    Released,
    Signer,
    SiloHalf,
    SiloSide,
    SumSpec,
)
from privacy.peers import ConsistencySignature
from privacy.ring import FixedPointCodec
from privacy.secagg.protocol import (
    AdvertisedKeys,
    Inbox,
    KeyList,
    MaskedInput,
    ProtocolViolation,
    Reveal,
    SecAggClient,
    SecAggServer,
    SessionSpec,
    Shares,
    Signatures,
    StageError,
    SurvivorList,
    Transcript,
)
from privacy.secagg.settings import SecAggSettings, SessionPolicy


def session_of(spec: SumSpec, codec: FixedPointCodec) -> SessionSpec:
    """The protocol session of a sum: the round's signed secagg settings ride in `spec.settings`."""
    settings = spec.settings if isinstance(spec.settings, SecAggSettings) else SecAggSettings()
    return settings.session(spec.round_id, spec.purpose, spec.silos, codec.ring, spec.binding)


def codec_of(spec: SumSpec) -> FixedPointCodec:
    """The sum's encoding for its silos; refuses a round that could overflow (`OverflowRisk`)."""
    return FixedPointCodec(spec.schema, max_silos=len(spec.silos))


class SecAggSiloHalf(SiloHalf):
    def __init__(
        self,
        spec: SumSpec,
        me: str,
        *,
        sign: Signer,
        peers: Peers,
        policy: SessionPolicy | None,
        may_release: Callable[[tuple[str, ...]], None],
    ) -> None:
        self.codec = codec_of(spec)
        session = session_of(spec, self.codec)
        if policy is not None:
            policy.check(session)
        self.client = SecAggClient(session, me, sign=sign, peers=peers)
        self._may_release = may_release
        self._encoded = None
        self._done = False
        self._result: torch.Tensor | None = None

    def start(self, vector: torch.Tensor) -> list[object]:
        self._encoded = self.codec.encode(vector)
        return [self.client.advertise()]

    def step(self, step: object) -> list[object]:
        if isinstance(step, KeyList):
            return [Shares(tuple(self.client.share(list(step.keys))))]
        if isinstance(step, Inbox):
            masked = self.client.masked_input(step, self._masking(self._encoded), in_place=True)
            return [MaskedInput(masked, self.client.masked_signature)]
        if isinstance(step, SurvivorList):
            signature = self.client.consistency(step.survivors, release=self._may_release)
            return [ConsistencySignature(signature)]
        if isinstance(step, Signatures):
            reveal = self.client.unmask(step.by_silo)
            self._done = not self.reads_sum
            return [reveal]
        if isinstance(step, Transcript):
            self._read(self.client.recompute(step))
            return []
        return self._other_step(step)

    @property
    def reads_sum(self) -> bool:
        """Whether this silo reads the sum itself (a census, which it recomputes), so its part ends there."""
        return self.client.spec.recomputed

    def _masking(self, encoded: np.ndarray) -> np.ndarray:
        """The ring vector the secure-aggregation masks go onto: the encoded input itself."""
        return encoded

    def _read(self, total: np.ndarray) -> None:
        """The sum over U3 in the ring, as this silo computed it."""
        self._result = self.codec.decode(total)
        self._done = True

    def _other_step(self, step: object) -> list[object]:
        raise ProtocolViolation(f"{type(step).__name__} is no secure-aggregation step")

    @property
    def done(self) -> bool:
        return self._done

    @property
    def result(self) -> torch.Tensor | None:
        """A sum this silo read itself (a census it recomputed; None for a sum only the aggregator reads);
        asked for one it has not read, it refuses: the count would be the aggregator's word alone."""
        if self.reads_sum and not self._done:
            raise ProtocolViolation(
                f"the {self.client.spec.purpose} result came before its transcript (or total): this silo has "
                "not read the sum, and takes no count the aggregator alone reports"
            )
        return self._result

    @property
    def counted(self) -> tuple[str, ...]:
        return self.client.survivors


class SecAggAggregatorHalf(AggregatorHalf):
    def __init__(self, spec: SumSpec, *, peers: Peers) -> None:
        self.spec = spec
        self.codec = codec_of(spec)
        self.server = SecAggServer(session_of(spec, self.codec), peers=peers)
        self._total: np.ndarray | None = None  # the unmasked sum, while its transcript goes out

    @property
    def stage(self) -> str:
        return self.server.stage

    @property
    def expected(self) -> tuple[str, ...]:
        return self.server.expected

    @property
    def answered(self) -> set[str]:
        return self.server.answered

    @property
    def counted(self) -> tuple[str, ...] | None:
        return self.server.u3 or None

    def receive(self, silo: str, message: object) -> None:
        server = self.server
        if isinstance(message, AdvertisedKeys):
            server.add_keys(silo, message)
        elif isinstance(message, Shares):
            server.add_envelopes(silo, message.envelopes)
        elif isinstance(message, MaskedInput):
            server.add_masked(silo, message.vector, message.signature)
        elif isinstance(message, ConsistencySignature):
            server.add_signature(silo, message.signature)
        elif isinstance(message, Reveal):
            server.add_reveal(silo, message)
        else:
            raise StageError(f"a {type(message).__name__} is no secure-aggregation message")

    def close(self) -> Mapping[str, object] | Released:
        server = self.server
        stage = server.stage
        if stage == "keys":
            keys = KeyList(tuple(server.close_keys()))
            return dict.fromkeys(server.u1, keys)
        if stage == "shares":
            return dict(server.close_shares())
        if stage == "masked":
            survivors = SurvivorList(server.close_masked())
            return dict.fromkeys(survivors.survivors, survivors)
        if stage == "consistency":
            signatures = Signatures(server.close_consistency())
            return dict.fromkeys(server.u4, signatures)
        if stage == "unmask":
            self._total = server.close_unmask()
            if server.stage == "transcript":  # silos act on this sum: each recomputes it first
                return dict.fromkeys(server.u4, server.transcript())
            return self._unmasked()
        server.close_transcript()  # refuses any other stage: nothing is left to close
        return self._released()

    def _unmasked(self) -> Mapping[str, object] | Released:
        """After the unmask stage of a sum silos do not recompute: the sum is the aggregator's."""
        return self._released()

    def _released(self) -> Released:
        return Released(self.server.u3, self.codec.decode(self._total))

    def upload_bytes(self, silo: str, kind: type) -> int:
        if kind is not MaskedInput:
            raise StageError(f"a secure sum takes masked inputs, not a {kind.__name__}")
        if self.server.stage != "masked":
            raise StageError(f"the {self.spec.purpose} sum is at {self.stage!r}, not 'masked'")
        return self.codec.ring.nbytes


class SecAggSiloSide(SiloSide):
    """A silo's keys (its certificate key signs, `peers` checks others) and, in a consortium, its policy."""

    def __init__(self, *, sign: Signer, peers: Peers, policy: SessionPolicy | None = None) -> None:
        self.sign, self.peers, self.policy = sign, peers, policy

    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        return SecAggSiloHalf(
            spec, me, sign=self.sign, peers=self.peers, policy=self.policy, may_release=may_release
        )

    def problems(self, spec: SumSpec) -> list[str]:
        return [] if self.policy is None else self.policy.problems(session_of(spec, codec_of(spec)))

    def min_counted(self, spec: SumSpec) -> int:
        return session_of(spec, codec_of(spec)).t  # a session with fewer survivors aborts


class SecAggAggregatorSide(AggregatorSide):
    def __init__(self, *, peers: Peers) -> None:
        self.peers = peers

    def half(self, spec: SumSpec) -> AggregatorHalf:
        return SecAggAggregatorHalf(spec, peers=self.peers)
