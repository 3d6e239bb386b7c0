"""Secure aggregation, transport-free: Bonawitz et al. (CCS 2017) with the consistency round, and SecAgg+.

One `SessionSpec` describes one secure sum of one round; every silo runs a `SecAggClient` and the aggregator
a `SecAggServer`, which only routes messages and, at the end, removes masks. The stages and survivor sets:

0. keys      each silo advertises two X25519 public keys, signed with its certificate key.      U1
1. shares    each silo Shamir-shares its self-mask seed b_u and its mask key s_u among its holders
             (itself and its neighbours), sealed to each holder; the aggregator only relays.      U2
2. masked    y_u = x_u + PRG(b_u) + Σ_{v ∈ U2 ∩ N(u)} ±PRG(s_uv)   (in the ring: `ring.Ring`)        U3
3. consistency  each survivor signs (session, RoundSpec hash, state digest, U3).                  U4
4. unmask    a silo that verified every signature reveals, per peer, b-shares of survivors (U3)
             or s-shares of the dropped (U2 \\ U3) — never both kinds for one peer.               U5
5. transcript  only in a sum silos act on (the census, `RECOMPUTED`): the aggregator relays every
             signed masked input of U3 and signed reveal of U5 to U4; each silo checks them against
             what it saw and signed, and unmasks the sum itself, with the aggregator's own code.

In a sum silos recompute, each silo also signs its masked input (`MASKED_CONTEXT`) and its reveal
(`REVEAL_CONTEXT`), and the aggregator checks each signature as the message arrives. A silo then acts only
on the sum it computed from what every counted silo signed, never on a number the aggregator reports: the
aggregator alone cannot make a class of one silo look like a class of k_min (a false census). It can still
withhold the transcript, and the silo then takes no census. The transcript gives each silo of U4 the
aggregator's view of the session, so silos colluding with one another learn from it what the aggregator
colluding with them would: over the complete graph, the sum of the other silos' inputs, which the census
says anyway (every pairwise mask between two silos outside the coalition stays in place); over SecAgg+'s
graph, also the input of a silo whose neighbours in U3 all collude, as for the aggregator.

Every stage needs at least t survivors and every rebuilt seed needs t shares from its holders; below that
the session aborts (`TooFewSurvivors`) and no sum is formed. A message that breaks the protocol (forged,
duplicated or replayed key, misaddressed envelope, a view that differs between silos) raises
`ProtocolViolation` at the silo, which then stops taking part. The neighbour graph is complete by default;
with `neighbours = k` it is SecAgg+'s Harary graph of degree k over a permutation drawn from the keys the
silos advertised in stage 0 (Bell et al., CCS 2020).

The graph's randomness is the silos' own fresh keys, which exist only after the aggregator has fixed the
round: re-drawing round ids no longer re-draws the graph. The aggregator can still choose which advertised
keys to pass on (U1), and a silo colluding with it could pick its keys after seeing the others', so a silo's
policy accepts sparse graphs only above a size it chooses (`SessionPolicy`). The consistency round signs the
key list's digest, so every silo is bound to the same keys and graph.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import random
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from fedlt.aggregation.halves import BadMessage, Peers, Signer, SumAborted, WrongStage
from fedlt.errors import FedltError
from privacy import crypto
from privacy.peers import BadSignature
from privacy.ring import Ring, apply_masks
from privacy.secagg import shamir

KEYS_CONTEXT = "fedlt/secagg/keys/v1"
CONSISTENCY_CONTEXT = "fedlt/secagg/consistency/v1"
MASKED_CONTEXT = "fedlt/secagg/masked/v1"
REVEAL_CONTEXT = "fedlt/secagg/reveal/v1"
MASK_PURPOSE = "fedlt/secagg/mask/v1"
ENVELOPE_PURPOSE = "fedlt/secagg/envelope/v1"
SHARE_BYTES = 66  # an element of the 521-bit Shamir field
# "evaluation": the counts sum of a layer whose silos step (blind), which a silo's policy checks as a session
PURPOSES = ("census", "contribution", "evaluation")
# Sums every silo recomputes from the signed transcript: small ones that silos act on. The contribution's
# sum is the aggregator's (its server step reads it), and relaying megabytes to every silo would cost more
# than the round.
RECOMPUTED = frozenset({"census"})


class SecAggError(SumAborted):
    """The secure sum cannot be completed."""


class TooFewSurvivors(SecAggError):
    """Fewer than the threshold of silos are left: the session aborts and releases no sum."""


class ProtocolViolation(SecAggError, BadMessage):
    """A message that breaks the protocol; the silo that sees it stops taking part in the session."""


class StageError(SecAggError, WrongStage):
    """A message for a stage that is not the current one, or from a silo not expected to send it."""


# --- what travels between silos and the aggregator ------------------------------------------------------


@dataclass(frozen=True)
class AdvertisedKeys:
    """Stage 0: `credential` lets peers check the signature (the silo's certificate PEM in a consortium)."""

    silo: str
    c_public: bytes
    s_public: bytes
    signature: bytes
    credential: bytes = b""


@dataclass(frozen=True)
class Envelope:
    sender: str
    recipient: str
    ciphertext: bytes


@dataclass(frozen=True)
class Inbox:
    """Stage 1's output for one silo: who is still in (U2) and the sealed shares addressed to it."""

    survivors: tuple[str, ...]
    envelopes: tuple[Envelope, ...]


@dataclass(frozen=True)
class Reveal:
    """Stage 4: shares of survivors' self-mask seeds and of dropped silos' mask keys, keyed by owner; signed
    by the silo in a sum silos recompute."""

    self_mask: Mapping[str, bytes]
    mask_key: Mapping[str, bytes]
    signature: bytes = field(default=b"", repr=False)

    def encoded(self) -> bytes:
        """The shares in one unambiguous order: what the signature covers."""

        def listed(by_owner: Mapping[str, bytes]) -> bytes:
            return crypto.transcript(*(part for item in sorted(by_owner.items()) for part in item))

        return crypto.transcript(listed(self.self_mask), listed(self.mask_key))


@dataclass(frozen=True)
class Shares:
    """Stage 1 from a silo: its envelopes, one to each holder of its seeds."""

    envelopes: tuple[Envelope, ...]


@dataclass(frozen=True)
class MaskedInput:
    """Stage 2 from a silo: its masked fixed-point vector (the bytes of a ring vector); signed by the silo in
    a sum silos recompute."""

    vector: np.ndarray = field(repr=False)
    signature: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class KeyList:
    """After stage 0, to every silo of U1: everyone's signed keys."""

    keys: tuple[AdvertisedKeys, ...]


@dataclass(frozen=True)
class SurvivorList:
    """After stage 2, to every silo of U3: whose masked inputs arrived."""

    survivors: tuple[str, ...]


@dataclass(frozen=True)
class Signatures:
    """After stage 3, to every silo of U4: every consistency signature, by signer."""

    by_silo: Mapping[str, bytes]


@dataclass(frozen=True)
class Transcript:
    """After stage 4 of a sum silos recompute, to every silo of U4: the signed masked inputs of U3 and the
    signed reveals of U5, by silo. U4 rather than U5: a silo whose reveal was lost can still recompute."""

    masked: Mapping[str, MaskedInput]
    reveals: Mapping[str, Reveal]


# --- the session ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    round_id: str
    purpose: str
    participants: tuple[str, ...]
    ring: Ring
    binding: bytes = field(default=b"", repr=False)  # what the consistency round signs: RoundSpec and state
    threshold: int = 0  # shares needed per seed; 0 = more than two thirds of a seed's holders
    neighbours: int = 0  # SecAgg+ degree (even); 0 or >= n - 1 = complete graph
    keys_digest: bytes = field(default=b"", repr=False)  # of the stage-0 key list: seeds the sparse graph

    def __post_init__(self) -> None:
        n = len(self.participants)
        problems = []
        if self.purpose not in PURPOSES:
            problems.append(f"unknown purpose {self.purpose!r}")
        if n < 2 or len(set(self.participants)) != n or list(self.participants) != sorted(self.participants):
            problems.append("participants must be at least two distinct, sorted silo ids")
        if self.neighbours < 0 or self.neighbours % 2:
            problems.append(f"neighbours must be even and >= 0, got {self.neighbours}")
        if problems:
            raise SecAggError("; ".join(problems))
        m = self.holder_count
        if self.threshold and not m // 2 < self.threshold <= m:
            raise SecAggError(
                f"threshold {self.threshold} must be a majority of each seed's {m} holders and at most {m}"
            )

    @property
    def session(self) -> bytes:
        return crypto.transcript(self.round_id, self.purpose)

    @property
    def recomputed(self) -> bool:
        """Whether every silo recomputes this sum itself from the signed transcript (stage 5)."""
        return self.purpose in RECOMPUTED

    @property
    def complete(self) -> bool:
        return self.neighbours == 0 or self.neighbours >= len(self.participants) - 1

    @property
    def holder_count(self) -> int:
        return len(self.participants) if self.complete else self.neighbours + 1

    @property
    def t(self) -> int:
        """Shares needed to rebuild a seed, and the fewest survivors a stage may have."""
        return self.threshold or default_threshold(self.holder_count)

    @cached_property
    def graph(self) -> dict[str, frozenset[str]]:
        """Each silo's neighbours (itself excluded); symmetric."""
        ids = list(self.participants)
        if self.complete:
            return {u: frozenset(ids) - {u} for u in ids}
        if not self.keys_digest:
            raise StageError("a sparse graph is drawn from the advertised keys, which stage 0 has not closed")
        seed = hashlib.sha256(
            crypto.transcript("fedlt/secagg/graph/v1", self.session, self.keys_digest)
        ).digest()
        ring = ids[:]
        random.Random(seed).shuffle(ring)  # placement only; secrecy comes from the seeds, not the graph
        half, n = self.neighbours // 2, len(ring)
        return {
            u: frozenset(ring[(i + d) % n] for d in range(-half, half + 1) if d) for i, u in enumerate(ring)
        }

    def holders(self, owner: str) -> tuple[str, ...]:
        """Who holds shares of `owner`'s seeds, in x-coordinate order (x = position + 1)."""
        return tuple(sorted(self.graph[owner] | {owner}))

    def x_of(self, owner: str, holder: str) -> int:
        return self.holders(owner).index(holder) + 1

    def consistency_message(self, survivors: Sequence[str]) -> bytes:
        return crypto.transcript(self.session, self.binding, self.keys_digest, *sorted(survivors))

    def masked_message(self, silo: str, masked: np.ndarray) -> bytes:
        """What a silo signs of its masked input: the session, the key list, itself, the vector's SHA-256."""
        digest = hashlib.sha256(masked.tobytes()).digest()
        return crypto.transcript(self.session, self.keys_digest, silo, digest)

    def reveal_message(self, silo: str, reveal: Reveal) -> bytes:
        return crypto.transcript(self.session, self.keys_digest, silo, reveal.encoded())

    def with_keys(self, keys: Sequence[AdvertisedKeys]) -> SessionSpec:
        """This session once stage 0 is closed: its graph and consistency message depend on the key list."""
        listed = [
            crypto.transcript(k.silo, k.c_public, k.s_public) for k in sorted(keys, key=lambda k: k.silo)
        ]
        digest = hashlib.sha256(
            crypto.transcript("fedlt/secagg/keys-list/v1", self.session, *listed)
        ).digest()
        return replace(self, keys_digest=digest)

    def key_message(self, keys: AdvertisedKeys) -> bytes:
        return crypto.transcript(self.session, keys.silo, keys.c_public, keys.s_public)


def _sign_of(u: str, v: str) -> bool:
    """Whether u subtracts (rather than adds) the mask it shares with v; the two ends always disagree."""
    return u < v


def _check_enough(spec: SessionSpec, alive: set[str], stage: str) -> None:
    """At least t silos alive, and t alive holders of each one's seeds (its alive neighbours and itself):
    every silo runs this on each survivor list, so it reads the graph's sets rather than sorting holders."""
    t = spec.t
    if len(alive) < t:
        raise TooFewSurvivors(f"{stage}: {len(alive)} silos left, the threshold is {t}")
    graph = spec.graph
    thin = sorted(u for u in alive if len(graph[u] & alive) + 1 < t)
    if thin:
        raise TooFewSurvivors(f"{stage}: fewer than {t} holders left for the seeds of {', '.join(thin)}")


def _check_usable(keys: AdvertisedKeys) -> None:
    """Keys no peer could use would make every honest silo abort; they are refused where they first appear."""
    if keys.c_public == keys.s_public:
        raise ProtocolViolation(f"{keys.silo} advertises one key for both purposes")
    try:
        crypto.check_public(keys.c_public)
        crypto.check_public(keys.s_public)
    except crypto.CryptoError as exc:
        raise ProtocolViolation(f"{keys.silo}: {exc}") from None


def _verify(
    peers: Peers, silo: str, credential: bytes, signature: bytes, data: bytes, *, context: str
) -> None:
    """`peers.verify`, a refused signature raised as what it is here: a message that breaks the protocol."""
    try:
        peers.verify(silo, credential, signature, data, context=context)
    except BadSignature as exc:
        raise ProtocolViolation(str(exc)) from None


def _encode_share(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def _decode_share(raw: bytes) -> int:
    if len(raw) != SHARE_BYTES:
        raise ProtocolViolation(f"a share has {SHARE_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


# --- a silo ---------------------------------------------------------------------------------------------


class SecAggClient:
    """One silo's half of one session. Each stage method runs once, in order; any violation ends it."""

    def __init__(self, spec: SessionSpec, me: str, *, sign: Signer, peers: Peers, credential: bytes = b""):
        if me not in spec.participants:
            raise SecAggError(f"{me} is not a participant of {spec.round_id}")
        self.spec, self.me, self._sign, self._peers, self._credential = spec, me, sign, peers, credential
        self._c = crypto.new_private_key()
        self._s = crypto.new_private_key()
        self._b = secrets.token_bytes(shamir.SECRET_BYTES)
        self._stage = "keys"
        self._keys: dict[str, AdvertisedKeys] = {}
        self._held: dict[str, tuple[int, int]] = {}  # owner -> (b share, s share) sealed to me
        self._envelope_keys: dict[str, bytes] = {}
        self._u2: set[str] = set()
        self._u3: tuple[str, ...] = ()
        self._u4: frozenset[str] = frozenset()
        self._masked_signature = b""

    @property
    def survivors(self) -> tuple[str, ...]:
        """U3 as this silo signed it (empty before the consistency stage)."""
        return self._u3

    @property
    def signers(self) -> tuple[str, ...]:
        """U4 as this silo verified it: every silo whose consistency signature it checked before revealing."""
        return tuple(sorted(self._u4))

    @property
    def masked_signature(self) -> bytes:
        """This silo's signature of its masked input, in a sum silos recompute (empty otherwise)."""
        return self._masked_signature

    def _enter(self, stage: str, following: str) -> None:
        if self._stage != stage:
            raise StageError(f"{self.me}: asked for stage {stage!r} while at {self._stage!r}")
        self._stage = following

    def advertise(self) -> AdvertisedKeys:
        self._enter("keys", "shares")
        unsigned = AdvertisedKeys(self.me, crypto.public_bytes(self._c), crypto.public_bytes(self._s), b"")
        signature = self._sign(self.spec.key_message(unsigned), context=KEYS_CONTEXT)
        return AdvertisedKeys(
            unsigned.silo, unsigned.c_public, unsigned.s_public, signature, self._credential
        )

    def share(self, advertised: Sequence[AdvertisedKeys]) -> list[Envelope]:
        """Check every peer's signed keys, then seal shares of b_u and s_u to each holder still in (U1)."""
        self._enter("shares", "masked")
        keys = self._checked_keys(advertised)
        u1 = set(keys)
        self.spec = self.spec.with_keys(list(keys.values()))
        _check_enough(self.spec, u1, "keys")
        self._keys = keys
        holders = self.spec.holders(self.me)
        t = self.spec.t
        b_shares = shamir.split(self._b, shares=len(holders), threshold=t)
        s_shares = shamir.split(crypto.private_bytes(self._s), shares=len(holders), threshold=t)
        envelopes = []
        for x, holder in enumerate(holders, start=1):
            if holder == self.me:
                self._held[self.me] = (b_shares[x], s_shares[x])
            elif holder in u1:
                plain = crypto.transcript(
                    self.me, holder, _encode_share(b_shares[x]), _encode_share(s_shares[x])
                )
                sealed = crypto.seal(self._envelope_key(holder), plain, self._envelope_aad(self.me, holder))
                envelopes.append(Envelope(self.me, holder, sealed))
        return envelopes

    def _checked_keys(self, advertised: Sequence[AdvertisedKeys]) -> dict[str, AdvertisedKeys]:
        keys: dict[str, AdvertisedKeys] = {}
        seen: set[bytes] = set()
        for entry in advertised:
            if entry.silo not in self.spec.participants:
                raise ProtocolViolation(f"keys from {entry.silo!r}, who is not a participant")
            if entry.silo in keys:
                raise ProtocolViolation(f"two key sets for {entry.silo}")
            if {entry.c_public, entry.s_public} & seen:
                raise ProtocolViolation(f"{entry.silo} advertises a public key that is already in use")
            _check_usable(entry)
            _verify(
                self._peers,
                entry.silo,
                entry.credential,
                entry.signature,
                self.spec.key_message(entry),
                context=KEYS_CONTEXT,
            )
            seen |= {entry.c_public, entry.s_public}
            keys[entry.silo] = entry
        mine = keys.get(self.me)
        if mine is None or (mine.c_public, mine.s_public) != (
            crypto.public_bytes(self._c),
            crypto.public_bytes(self._s),
        ):
            raise ProtocolViolation("the key list does not carry this silo's own keys unchanged")
        return keys

    def masked_input(self, inbox: Inbox, vector: np.ndarray, *, in_place: bool = False) -> np.ndarray:
        """Open the shares sealed to this silo, then mask `vector` (a ring vector) for U2: a copy of it, or
        `vector` itself if `in_place` (a caller done with it saves a pass over megabytes)."""
        self._enter("masked", "consistency")
        try:
            self.spec.ring.check(vector)
        except ValueError as exc:
            raise SecAggError(f"the session's ring: {exc}") from None
        u2 = set(inbox.survivors)
        if not u2 <= set(self._keys) or self.me not in u2:
            raise ProtocolViolation(
                "the survivor list names silos that advertised no keys, or omits this silo"
            )
        _check_enough(self.spec, u2, "shares")
        expected = (u2 & self.spec.graph[self.me]) | {self.me}
        for envelope in inbox.envelopes:
            if envelope.recipient != self.me or envelope.sender not in expected:
                raise ProtocolViolation(
                    f"an envelope from {envelope.sender} to {envelope.recipient} is misrouted"
                )
            if envelope.sender in self._held:
                raise ProtocolViolation(f"a second envelope from {envelope.sender}")
            self._held[envelope.sender] = self._open(envelope)
        missing = sorted(expected - set(self._held))
        if missing:
            raise ProtocolViolation(
                f"no shares from {', '.join(missing)}, though they are listed as survivors"
            )
        self._u2 = u2
        masked = vector if in_place else vector.copy()
        pairs = [(self._pair_seed(v), _sign_of(self.me, v)) for v in sorted(expected - {self.me})]
        apply_masks(self.spec.ring, masked, [(self._b, False), *pairs])
        if self.spec.recomputed:
            message = self.spec.masked_message(self.me, masked)
            self._masked_signature = self._sign(message, context=MASKED_CONTEXT)
        return masked

    def consistency(
        self, survivors: Sequence[str], *, release: Callable[[tuple[str, ...]], None] = lambda _: None
    ) -> bytes:
        """Sign what this silo was shown: the round it runs, the state it trained on, who is still in.

        `release` is asked, once the survivor list is known to be plausible and before the signature is made,
        whether this silo may release its input in a sum over those survivors; it raises to refuse.
        """
        self._enter("consistency", "unmask")
        u3 = set(survivors)
        if len(u3) != len(survivors) or not u3 <= self._u2 or self.me not in u3:
            raise ProtocolViolation("the masked-input survivors are not a subset of the earlier survivors")
        _check_enough(self.spec, u3, "masked input")
        release(tuple(sorted(u3)))
        self._u3 = tuple(sorted(u3))
        return self._sign(self.spec.consistency_message(self._u3), context=CONSISTENCY_CONTEXT)

    def unmask(self, signatures: Mapping[str, bytes]) -> Reveal:
        """Verify every survivor signed the same view; only then reveal, never both shares of one peer."""
        self._enter("unmask", "transcript" if self.spec.recomputed else "done")
        signers = set(signatures)
        if not signers <= set(self._u3) or self.me not in signers:
            raise ProtocolViolation("consistency signatures from silos outside the survivor set")
        if len(signers) < self.spec.t:
            raise TooFewSurvivors(f"consistency: {len(signers)} signatures, the threshold is {self.spec.t}")
        message = self.spec.consistency_message(self._u3)
        for silo in sorted(signers):
            keys = self._keys[silo]
            try:
                self._peers.verify(
                    silo, keys.credential, signatures[silo], message, context=CONSISTENCY_CONTEXT
                )
            except FedltError as exc:
                raise ProtocolViolation(
                    f"{silo} signed a different view of this round (survivors, state or RoundSpec): {exc}"
                ) from None
        self._u4 = frozenset(signers)
        alive = set(self._u3)
        self_mask = {o: _encode_share(b) for o, (b, _) in self._held.items() if o in alive}
        mask_key = {o: _encode_share(s) for o, (_, s) in self._held.items() if o in self._u2 - alive}
        assert not self_mask.keys() & mask_key.keys()  # the invariant that keeps double masking safe
        reveal = Reveal(self_mask, mask_key)
        if not self.spec.recomputed:
            return reveal
        signature = self._sign(self.spec.reveal_message(self.me, reveal), context=REVEAL_CONTEXT)
        return replace(reveal, signature=signature)

    def recompute(self, transcript: Transcript) -> np.ndarray:
        """Σ_{u ∈ U3} x_u in the ring, unmasked here from what every silo signed, as the aggregator does.

        The transcript must hold the masked inputs of exactly the survivors this silo signed for (U3), each
        signed by its silo, and reveals only from silos whose consistency signature this silo verified (U4),
        each signed, each for the silos this silo's view says (never both kinds for one peer), enough of them
        for every seed. Anything else means the aggregator relayed something the silos did not send.
        """
        self._enter("transcript", "done")
        if set(transcript.masked) != set(self._u3):
            raise ProtocolViolation(
                "the transcript's masked inputs are not those of the survivors this silo signed"
            )
        strangers = sorted(set(transcript.reveals) - self._u4)
        if strangers:
            raise ProtocolViolation(
                f"reveals from {', '.join(strangers)}, who signed no consistency signature here"
            )
        total = self.spec.ring.zeros()
        for silo in self._u3:
            masked = transcript.masked[silo]
            message = self.spec.masked_message(silo, masked.vector)
            self._check_signed(silo, masked.signature, message, MASKED_CONTEXT, "masked input")
            try:
                self.spec.ring.add(total, masked.vector)
            except ValueError as exc:
                raise ProtocolViolation(f"{silo}'s masked input: {exc}") from None
        for silo, reveal in sorted(transcript.reveals.items()):
            check_reveal(self.spec, silo, reveal, u2=self._u2, u3=self._u3)
            message = self.spec.reveal_message(silo, reveal)
            self._check_signed(silo, reveal.signature, message, REVEAL_CONTEXT, "reveal")
        try:
            return unmasked(
                self.spec, self._keys, u2=self._u2, u3=self._u3, total=total, reveals=transcript.reveals
            )
        except TooFewSurvivors as exc:
            raise ProtocolViolation(f"the transcript cannot be the aggregator's: {exc}") from None

    def _check_signed(self, silo: str, signature: bytes, message: bytes, context: str, what: str) -> None:
        try:
            self._peers.verify(silo, self._keys[silo].credential, signature, message, context=context)
        except FedltError as exc:
            raise ProtocolViolation(
                f"the transcript's {what} of {silo} is not one it signed: {exc}"
            ) from None

    def _envelope_key(self, peer: str) -> bytes:
        """The key of this silo's envelopes with `peer` both ways (sealing, opening): agreed once."""
        if peer not in self._envelope_keys:
            self._envelope_keys[peer] = crypto.agree(
                self._c,
                self._keys[peer].c_public,
                purpose=ENVELOPE_PURPOSE,
                session=self.spec.session,
                pair=(self.me, peer),
            )
        return self._envelope_keys[peer]

    def _envelope_aad(self, sender: str, recipient: str) -> bytes:
        return crypto.transcript(self.spec.session, sender, recipient)

    def _open(self, envelope: Envelope) -> tuple[int, int]:
        try:
            plain = crypto.open_sealed(
                self._envelope_key(envelope.sender),
                envelope.ciphertext,
                self._envelope_aad(envelope.sender, envelope.recipient),
            )
        except crypto.CryptoError as exc:
            raise ProtocolViolation(f"envelope from {envelope.sender}: {exc}") from None
        expected = crypto.transcript(envelope.sender, self.me)
        if not plain.startswith(expected) or len(plain) != len(expected) + 2 * (4 + SHARE_BYTES):
            raise ProtocolViolation(f"envelope from {envelope.sender} names another sender or recipient")
        rest = plain[len(expected) :]
        return _decode_share(rest[4 : 4 + SHARE_BYTES]), _decode_share(rest[8 + SHARE_BYTES :])

    def _pair_seed(self, peer: str) -> bytes:
        return pair_seed(self.spec, self._s, self.me, self._keys[peer].s_public, peer)

    def pair_key(self, peer: str, label: bytes) -> bytes:
        """A key for `label` that only this silo and `peer` (of the key list) can derive: an HMAC under the
        mask seed the two agreed in this session, never the seed itself (the blind layer masks its
        evaluation counts with it, where no session of its own runs)."""
        if peer == self.me or peer not in self._keys:
            raise ProtocolViolation(f"{peer} shares no mask seed with {self.me} in this session")
        return hmac.new(self._pair_seed(peer), label, hashlib.sha256).digest()


def pair_seed(
    spec: SessionSpec, private: crypto.X25519PrivateKey, me: str, peer_public: bytes, peer: str
) -> bytes:
    return crypto.agree(private, peer_public, purpose=MASK_PURPOSE, session=spec.session, pair=(me, peer))


# --- the aggregator -----------------------------------------------------------------------------------


class SecAggServer:
    """Relays the silos' messages and, at the end, removes the masks: it learns the sum over U3 and no more.

    Each `add_*` takes one silo's message for the current stage (the silo's identity comes from the
    transport, never from the message); each `close_*` ends a stage with whoever answered and returns what
    goes out next, or raises `TooFewSurvivors`. The masked inputs are added up as they arrive; in a sum silos
    recompute they are kept too, with their signatures, for the transcript.
    """

    def __init__(self, spec: SessionSpec, *, peers: Peers) -> None:
        self.spec = spec
        self._peers = peers
        self.stage = "keys"
        self._keys: dict[str, AdvertisedKeys] = {}
        self._envelopes: dict[str, tuple[Envelope, ...]] = {}
        self._masked_digests: dict[str, str] = {}
        self._signed_masked: dict[str, MaskedInput] = {}  # a sum silos recompute: for the transcript
        self._total = spec.ring.zeros()
        self._signatures: dict[str, bytes] = {}
        self._reveals: dict[str, Reveal] = {}
        self.u1: tuple[str, ...] = ()
        self.u2: tuple[str, ...] = ()
        self.u3: tuple[str, ...] = ()
        self.u4: tuple[str, ...] = ()

    @property
    def answered(self) -> set[str]:
        """Who has sent their message for the current stage."""
        return set(
            {
                "keys": self._keys,
                "shares": self._envelopes,
                "masked": self._masked_digests,
                "consistency": self._signatures,
                "unmask": self._reveals,
            }.get(self.stage, ())
        )

    @property
    def expected(self) -> tuple[str, ...]:
        """Who may send a message for the current stage."""
        return {
            "keys": self.spec.participants,
            "shares": self.u1,
            "masked": self.u2,
            "consistency": self.u3,
            "unmask": self.u4,
        }.get(self.stage, ())

    def _accept(self, stage: str, silo: str) -> bool:
        """Whether this is news; False for an identical repeat (a silo that resends after a reconnect)."""
        if self.stage != stage:
            raise StageError(
                f"{self.spec.purpose} sum of {self.spec.round_id} is at {self.stage!r}, not {stage!r}"
            )
        if silo not in self.expected:
            raise StageError(f"{silo} is not expected at stage {stage!r}")
        return silo not in self.answered

    def add_keys(self, silo: str, keys: AdvertisedKeys) -> None:
        if not self._accept("keys", silo):
            if self._keys[silo] != keys:
                raise ProtocolViolation(f"{silo} already advertised other keys")
            return
        if keys.silo != silo:
            raise ProtocolViolation(f"{silo} advertised keys in the name of {keys.silo}")
        used = {k for other in self._keys.values() for k in (other.c_public, other.s_public)}
        if {keys.c_public, keys.s_public} & used:
            raise ProtocolViolation(f"{silo} advertised a public key another silo already uses")
        _check_usable(keys)
        _verify(
            self._peers,
            silo,
            keys.credential,
            keys.signature,
            self.spec.key_message(keys),
            context=KEYS_CONTEXT,
        )
        self._keys[silo] = keys

    def _closing(self, stage: str) -> None:
        if self.stage != stage:
            raise StageError(
                f"cannot close stage {stage!r}: the {self.spec.purpose} sum is at {self.stage!r}"
            )

    def close_keys(self) -> list[AdvertisedKeys]:
        self._closing("keys")
        u1 = set(self._keys)
        self.spec = self.spec.with_keys(list(self._keys.values()))
        _check_enough(self.spec, u1, "keys")
        self.u1, self.stage = tuple(sorted(u1)), "shares"
        return [self._keys[u] for u in self.u1]

    def add_envelopes(self, silo: str, envelopes: Sequence[Envelope]) -> None:
        if not self._accept("shares", silo):
            if self._envelopes[silo] != tuple(envelopes):
                raise ProtocolViolation(f"{silo} already sent other shares")
            return
        recipients = [e.recipient for e in envelopes]
        wanted = set(self.spec.holders(silo)) & set(self.u1) - {silo}
        if any(e.sender != silo for e in envelopes) or sorted(recipients) != sorted(wanted):
            raise ProtocolViolation(f"{silo} must send one envelope to each of {sorted(wanted)}, from itself")
        self._envelopes[silo] = tuple(envelopes)

    def close_shares(self) -> dict[str, Inbox]:
        self._closing("shares")
        u2 = set(self._envelopes)
        _check_enough(self.spec, u2, "shares")
        self.u2, self.stage = tuple(sorted(u2)), "masked"
        return {
            u: Inbox(self.u2, tuple(e for s in self.u2 for e in self._envelopes[s] if e.recipient == u))
            for u in self.u2
        }

    def add_masked(self, silo: str, masked: np.ndarray, signature: bytes = b"") -> None:
        """A silo's masked input; in a sum silos recompute, with its signature, checked here."""
        digest = hashlib.sha256(masked.tobytes()).hexdigest()
        if not self._accept("masked", silo):
            if self._masked_digests[silo] != digest:
                raise ProtocolViolation(f"{silo} already sent another masked input")
            return
        try:
            self.spec.ring.check(masked)
        except ValueError as exc:
            raise ProtocolViolation(f"a masked input: {exc}") from None
        if self.spec.recomputed:
            message = self.spec.masked_message(silo, masked)
            _verify(
                self._peers, silo, self._keys[silo].credential, signature, message, context=MASKED_CONTEXT
            )
            self._signed_masked[silo] = MaskedInput(masked.copy(), signature)
        self.spec.ring.add(self._total, masked)
        self._masked_digests[silo] = digest

    def close_masked(self) -> tuple[str, ...]:
        self._closing("masked")
        u3 = set(self._masked_digests)
        _check_enough(self.spec, u3, "masked input")
        self.u3, self.stage = tuple(sorted(u3)), "consistency"
        return self.u3

    def add_signature(self, silo: str, signature: bytes) -> None:
        if not self._accept("consistency", silo):
            if self._signatures[silo] != signature:
                raise ProtocolViolation(f"{silo} already sent another consistency signature")
            return
        message = self.spec.consistency_message(self.u3)
        _verify(
            self._peers, silo, self._keys[silo].credential, signature, message, context=CONSISTENCY_CONTEXT
        )
        self._signatures[silo] = signature

    def close_consistency(self) -> dict[str, bytes]:
        self._closing("consistency")
        u4 = set(self._signatures)
        if len(u4) < self.spec.t:
            raise TooFewSurvivors(f"consistency: {len(u4)} signatures, the threshold is {self.spec.t}")
        self.u4, self.stage = tuple(sorted(u4)), "unmask"
        return dict(sorted(self._signatures.items()))

    def add_reveal(self, silo: str, reveal: Reveal) -> None:
        """A silo's shares; in a sum silos recompute, with its signature, checked here."""
        if not self._accept("unmask", silo):
            if self._reveals[silo] != reveal:
                raise ProtocolViolation(f"{silo} already revealed other shares")
            return
        check_reveal(self.spec, silo, reveal, u2=self.u2, u3=self.u3)
        if self.spec.recomputed:
            message = self.spec.reveal_message(silo, reveal)
            _verify(
                self._peers,
                silo,
                self._keys[silo].credential,
                reveal.signature,
                message,
                context=REVEAL_CONTEXT,
            )
        self._reveals[silo] = reveal

    def close_unmask(self) -> np.ndarray:
        """Rebuild the seeds, remove every mask, and return Σ_{u ∈ U3} x_u in the ring (`unmasked`: the masks
        come off the running total itself). A sum silos recompute goes on to its transcript stage."""
        self._closing("unmask")
        self.stage = "transcript" if self.spec.recomputed else "done"
        return unmasked(
            self.spec, self._keys, u2=self.u2, u3=self.u3, total=self._total, reveals=self._reveals
        )

    def transcript(self) -> Transcript:
        """What every silo of U4 recomputes the sum from: the signed messages this server summed."""
        if self.stage != "transcript":
            raise StageError(f"the {self.spec.purpose} sum has no transcript at {self.stage!r}")
        return Transcript(dict(sorted(self._signed_masked.items())), dict(sorted(self._reveals.items())))

    def close_transcript(self) -> None:
        """The transcript went out; no silo answers it."""
        self._closing("transcript")
        self.stage = "done"


def check_reveal(
    spec: SessionSpec, silo: str, reveal: Reveal, *, u2: Iterable[str], u3: Iterable[str]
) -> None:
    """A reveal holds, for each owner among `silo`'s holders, the share of its self-mask seed if the owner is
    in U3 and of its mask key if it dropped (U2 \\ U3): never both kinds for one owner, none for others."""
    mine = set(spec.graph[silo]) | {silo}
    alive, dropped = set(u3) & mine, (set(u2) - set(u3)) & mine
    if set(reveal.self_mask) != alive or set(reveal.mask_key) != dropped:
        raise ProtocolViolation(f"{silo} revealed shares for the wrong silos")


def unmasked(
    spec: SessionSpec,
    keys: Mapping[str, AdvertisedKeys],
    *,
    u2: Iterable[str],
    u3: Iterable[str],
    total: np.ndarray,
    reveals: Mapping[str, Reveal],
) -> np.ndarray:
    """Σ_{u ∈ U3} x_u in the ring, from `total`, the sum of U3's masked inputs: rebuild the self-mask seed of
    every survivor and the mask key of every dropped silo that shares a mask with one, remove every mask.
    The masks come off `total` itself, which is returned: both callers are done with their masked sum, and a
    copy would be one more pass over megabytes. The aggregator (`SecAggServer.close_unmask`) and every silo
    recomputing a sum (`SecAggClient.recompute`) run this one function, so both get the same sum from the
    same messages.

    A holder that alters a self-mask share when exactly t shares arrive makes the sum wrong undetected
    (b_u carries no commitment); with more than t, `shamir.combine` catches it. A malicious silo can skew
    the sum through its own input anyway, so the protocol promises privacy, not robustness, against it.
    """
    survivors, dropped = set(u3), set(u2) - set(u3)
    masks = [(_rebuild(spec, u, reveals, lambda r: r.self_mask), True) for u in sorted(survivors)]
    for v in sorted(dropped):
        partners = sorted(spec.graph[v] & survivors)
        if not partners:
            continue
        secret = crypto.private_key_from(_rebuild(spec, v, reveals, lambda r: r.mask_key))
        if crypto.public_bytes(secret) != keys[v].s_public:
            raise ProtocolViolation(f"the shares rebuild a mask key that {v} never advertised")
        # u added PRG(s_uv) unless u < v; undo exactly what u did
        masks += [(pair_seed(spec, secret, v, keys[u].s_public, u), not _sign_of(u, v)) for u in partners]
    apply_masks(spec.ring, total, masks)
    return total


def _rebuild(
    spec: SessionSpec,
    owner: str,
    reveals: Mapping[str, Reveal],
    pick: Callable[[Reveal], Mapping[str, bytes]],
) -> bytes:
    shares = {
        x: _decode_share(pick(reveals[h])[owner])
        for x, h in enumerate(spec.holders(owner), start=1)  # x = place among the holders, as `x_of`
        if h in reveals
    }
    if len(shares) < spec.t:
        raise TooFewSurvivors(f"unmask: {len(shares)} shares for {owner}'s seed, the threshold is {spec.t}")
    try:
        return shamir.combine(shares, threshold=spec.t)
    except shamir.ShamirError as exc:
        raise ProtocolViolation(f"shares of {owner}'s seed: {exc}") from None


def default_threshold(holders: int) -> int:
    """More than two thirds of a seed's holders, and never fewer than two."""
    return max(2, math.floor(2 * holders / 3) + 1)
