"""Secure aggregation probed as a hostile aggregator or silo would probe it.

Dropouts at every stage are checked against a reference predicate written from the protocol's promise (exact
sum over U3, or `TooFewSurvivors`, never a wrong sum); forged, duplicated, replayed, misrouted and tampered
messages must each be refused with `ProtocolViolation` (or `StageError`); one masked upload must look like
noise. The primitives (PRG, Shamir, codec overflow) are tested in tests/test_secagg_primitives.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema, make_layer
from privacy import crypto
from privacy.peers import KeyPeers
from privacy.pki.signing import sign
from privacy.ring import BLOCK_BYTES, FixedPointCodec, Ring
from privacy.secagg import shamir
from privacy.secagg.layer import SecAggSum
from privacy.secagg.local import STAGES, run_session
from privacy.secagg.protocol import (
    CONSISTENCY_CONTEXT,
    KEYS_CONTEXT,
    MASKED_CONTEXT,
    REVEAL_CONTEXT,
    SHARE_BYTES,
    AdvertisedKeys,
    Envelope,
    Inbox,
    ProtocolViolation,
    Reveal,
    SecAggClient,
    SecAggError,
    SecAggServer,
    SessionSpec,
    StageError,
    TooFewSurvivors,
    Transcript,
    default_threshold,
)
from privacy.secagg.settings import SecAggSettings

RING = Ring(wide=9, narrow=7)  # both word sizes, an odd count of each
A, B, C, D = "silo-00", "silo-01", "silo-02", "silo-03"


def silo_ids(n: int) -> tuple[str, ...]:
    return tuple(f"silo-{i:02d}" for i in range(n))


# The sparse graph is drawn from the keys silos advertise, which exist only once a session runs. The reference
# predicate below must know the graph beforehand, so this module fixes the draw (as FCP's tests fix the PRNG);
# tests/test_malicious_aggregator.py checks the real draw.
REFERENCE_GRAPH = b"reference graph"


@pytest.fixture(scope="module", autouse=True)
def reference_graph():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SessionSpec, "with_keys", lambda spec, keys: replace(spec, keys_digest=REFERENCE_GRAPH))
        yield


def make_spec(n: int, **changes) -> SessionSpec:
    fields = {
        "round_id": "r3.a1",
        "purpose": "contribution",
        "participants": silo_ids(n),
        "ring": RING,
        "keys_digest": REFERENCE_GRAPH,
    }
    return SessionSpec(**(fields | changes))


def random_words(spec: SessionSpec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {u: spec.ring.random(rng) for u in spec.participants}


def ring_sum(vectors: Iterable[np.ndarray], ring: Ring) -> np.ndarray:
    """The expected sum, word by word in Python integers (mod 2^64 for wide words, 2^32 for narrow ones), so
    it does not lean on numpy's wrap-around as the code does."""
    vectors, total = list(vectors), ring.zeros()
    for index, bits in enumerate((64, 32)):
        sums = [0] * len(ring.parts(total)[index])
        for vector in vectors:
            words = ring.parts(vector)[index].tolist()
            sums = [(t + w) % 2**bits for t, w in zip(sums, words, strict=True)]
        ring.parts(total)[index][:] = sums
    return total


# --- the reference: who survives each stage, and whether the session must complete ----------------------


def stage_survivors(spec: SessionSpec, dropouts: Mapping[str, str]) -> list[set[str]]:
    """U1..U5: the silos that answer each stage (a silo dropped at stage s answered every earlier stage)."""
    first_missed = {u: STAGES.index(stage) for u, stage in dropouts.items()}
    return [
        {u for u in spec.participants if first_missed.get(u, len(STAGES)) > i} for i in range(len(STAGES))
    ]


def completes(spec: SessionSpec, dropouts: Mapping[str, str]) -> bool:
    """The protocol's promise, written out independently of the code that keeps it.

    Keys, shares and masked inputs each keep t silos, each with t holders of its seeds among them; t silos
    sign the view; and every seed the aggregator must rebuild (the self-mask seeds of U3, the mask keys of
    silos in U2 \\ U3 that share a mask with someone in U3) has t holders answering at unmask.
    """
    t = spec.t
    u1, u2, u3, u4, u5 = stage_survivors(spec, dropouts)

    def rebuildable(owner: str, among: set[str]) -> bool:
        return len((spec.graph[owner] | {owner}) & among) >= t

    if len(u4) < t or any(len(u) < t or not all(rebuildable(o, u) for o in u) for u in (u1, u2, u3)):
        return False
    rebuilt = u3 | {v for v in u2 - u3 if spec.graph[v] & u3}
    return all(rebuildable(o, u5) for o in rebuilt)


def check_outcome(spec: SessionSpec, dropouts: Mapping[str, str], seed: int, *, exact: bool = True) -> None:
    """run_session gives exactly Σ over the predicted U3 when the reference says so, and aborts otherwise.

    With `exact=False` a session the reference expects to abort may also complete (with the exact sum): the
    reference's early aborts for SecAgg+ are a choice of the code, not a safety property.
    """
    inputs = random_words(spec, seed)
    if not completes(spec, dropouts):
        try:
            summed, u3 = run_session(spec, inputs, dropouts=dropouts)
        except TooFewSurvivors:
            return
        assert not exact, f"completed, though {dropouts} leave too few silos for threshold {spec.t}"
    else:
        summed, u3 = run_session(spec, inputs, dropouts=dropouts)
    assert set(u3) == stage_survivors(spec, dropouts)[2]
    assert np.array_equal(summed, ring_sum((inputs[u] for u in u3), spec.ring))


@st.composite
def sessions(draw, sizes: tuple[int, ...], neighbours: int = 0) -> tuple[SessionSpec, dict[str, str], int]:
    """A session (any valid threshold) and any dropout set: each silo mapped to the stage it stops at."""
    spec = make_spec(draw(st.sampled_from(sizes)), neighbours=neighbours)
    m = spec.holder_count
    spec = replace(spec, threshold=draw(st.sampled_from([0, *range(m // 2 + 1, m + 1)])))
    dropouts = draw(st.dictionaries(st.sampled_from(spec.participants), st.sampled_from(STAGES)))
    return spec, dropouts, draw(st.integers(0, 2**32 - 1))


@given(sessions((2, 3, 5, 10)))
@settings(max_examples=100, deadline=None)
def test_complete_graph_sums_the_survivors_exactly_or_aborts(case):
    spec, dropouts, seed = case
    # for the complete graph the reference reduces to: every U_i has at least t silos
    assert completes(spec, dropouts) == all(len(u) >= spec.t for u in stage_survivors(spec, dropouts))
    event("completes" if completes(spec, dropouts) else "aborts")
    check_outcome(spec, dropouts, seed)


def spread(ids: tuple[str, ...]) -> list[str]:
    """Silos from both ends inwards, so dropouts hit both signs of the pairwise masks."""
    return [ids[i // 2] if i % 2 == 0 else ids[-1 - i // 2] for i in range(len(ids))]


@pytest.mark.parametrize("n", [2, 3, 5, 10])
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_tolerates_n_minus_t_dropouts_and_no_more(n, stage):
    """The boundary, deterministically for each stage: n - t silos may leave, one more aborts the session."""
    spec = make_spec(n)
    spare = spread(spec.participants)[: n - spec.t + 1]
    enough, too_few = dict.fromkeys(spare[:-1], stage), dict.fromkeys(spare, stage)
    assert completes(spec, enough)
    assert not completes(spec, too_few)
    check_outcome(spec, enough, seed=n)
    check_outcome(spec, too_few, seed=n)


@given(sessions((10, 12), neighbours=4))
@settings(max_examples=50, deadline=None)
def test_secagg_plus_sums_the_survivors_exactly_or_aborts(case):
    spec, dropouts, seed = case
    event("completes" if completes(spec, dropouts) else "aborts")
    check_outcome(spec, dropouts, seed, exact=False)


def test_secagg_plus_graph_without_and_with_a_tolerated_dropout():
    spec = make_spec(12, neighbours=4)
    assert not spec.complete
    assert (spec.holder_count, spec.t) == (5, 4)
    assert all(len(spec.graph[u]) == 4 and u not in spec.graph[u] for u in spec.participants)
    assert all(u in spec.graph[v] for u in spec.participants for v in spec.graph[u])  # symmetric
    check_outcome(spec, {}, seed=1)
    check_outcome(spec, {A: "masked"}, seed=2)  # its mask key is rebuilt from its 4 other holders
    assert completes(spec, {A: "masked"})


# --- floats through the codec --------------------------------------------------------------------------

CODEC_SCHEMA = Schema((Field("delta", (10,), 8.0, frac_bits=20), Field("count", (6,), 500.0, frac_bits=0)))


@given(n=st.integers(3, 6), data=st.data())
@settings(max_examples=25, deadline=None)
def test_float_sums_over_the_survivors_are_within_the_codec_bound(n, data):
    codec = FixedPointCodec(CODEC_SCHEMA, max_silos=n)
    spec = make_spec(n, ring=codec.ring, threshold=n // 2 + 1)
    ranges = {"delta": 12.0, "count": 800.0}  # beyond the bounds, so clipping is exercised
    rows = {
        u: np.concatenate(
            [
                data.draw(
                    st.lists(st.floats(-ranges[f.name], ranges[f.name]), min_size=f.size, max_size=f.size)
                )
                for f in CODEC_SCHEMA.fields
            ]
        )
        for u in spec.participants
    }
    dropouts = data.draw(
        st.dictionaries(st.sampled_from(spec.participants), st.sampled_from(STAGES), max_size=n - spec.t)
    )
    assert completes(spec, dropouts)
    encoded = {u: codec.encode(torch.from_numpy(row)) for u, row in rows.items()}
    summed, u3 = run_session(spec, encoded, dropouts=dropouts)
    bounds = np.concatenate([np.full(f.size, f.bound) for f in CODEC_SCHEMA.fields])
    truth = CODEC_SCHEMA.unflatten(torch.from_numpy(sum(np.clip(rows[u], -bounds, bounds) for u in u3)))
    decoded = CODEC_SCHEMA.unflatten(codec.decode(summed))
    for f in CODEC_SCHEMA.fields:
        # each value is rounded to the nearest multiple of 2^-f: the codec's promise, tighter than n * 2^-f
        error = (decoded[f.name] - truth[f.name]).abs().max().item()
        assert error <= len(u3) * 2.0 ** -(f.frac_bits + 1) + 1e-9, f.name


# --- a session driven by hand ----------------------------------------------------------------------------


class Bench:
    """The real clients and server of one session, stepped stage by stage as run_session does, so a test can
    stop, forge or reroute any message in between. Every message and stage output is kept."""

    def __init__(
        self, spec: SessionSpec, *, identities: Mapping[str, ec.EllipticCurvePrivateKey] | None = None
    ):
        self.spec = spec
        self.identities = dict(
            identities or {u: ec.generate_private_key(ec.SECP256R1()) for u in spec.participants}
        )
        self.peers = KeyPeers({u: key.public_key() for u, key in self.identities.items()})
        self.clients = {u: self.client(u) for u in spec.participants}
        self.server = SecAggServer(spec, peers=self.peers)
        self.inputs = random_words(spec, 0)
        self.advertised: dict[str, AdvertisedKeys] = {}
        self.sent: dict[str, list[Envelope]] = {}
        self.uploads: dict[str, np.ndarray] = {}
        self.signatures: dict[str, bytes] = {}
        self.reveals: dict[str, Reveal] = {}
        self.key_list: list[AdvertisedKeys] = []
        self.inboxes: dict[str, Inbox] = {}
        self.u3: tuple[str, ...] = ()
        self.signed: dict[str, bytes] = {}

    def signer(self, u: str) -> Callable[..., bytes]:
        key = self.identities[u]
        return lambda data, *, context: sign(key, data, context=context)

    def client(self, u: str, spec: SessionSpec | None = None) -> SecAggClient:
        return SecAggClient(spec or self.spec, u, sign=self.signer(u), peers=self.peers)

    def resigned(self, keys: AdvertisedKeys, **changes: bytes | str) -> AdvertisedKeys:
        """`keys` changed and validly signed by the silo they name: a misbehaving silo, not a forger."""
        changed = replace(keys, **changes)
        message = self.spec.key_message(changed)
        return replace(changed, signature=sign(self.identities[changed.silo], message, context=KEYS_CONTEXT))

    def run(
        self, dropouts: Mapping[str, str] | None = None, *, start: str = "keys", until: str = "done"
    ) -> None:
        """Play stages `start`..`until` (excluded) as run_session does, each silo stopping at its dropout
        stage; a silo the server has already heard from at the current stage is not asked again."""
        dropouts = dropouts or {}

        def answering(stage: str, among: Iterable[str]) -> list[str]:
            answers = [
                u for u in among if u not in dropouts or STAGES.index(dropouts[u]) > STAGES.index(stage)
            ]
            return [u for u in answers if not (self.server.stage == stage and u in self.server.answered)]

        steps: dict[str, Callable[[], None]] = {
            "keys": lambda: self._keys(answering("keys", self.spec.participants)),
            "shares": lambda: self._shares(answering("shares", self.server.u1)),
            "masked": lambda: self._masked(answering("masked", self.server.u2)),
            "consistency": lambda: self._consistency(answering("consistency", self.u3)),
            "unmask": lambda: self._unmask(answering("unmask", self.server.u4)),
        }
        for stage in STAGES[STAGES.index(start) : STAGES.index(until) if until in STAGES else None]:
            steps[stage]()

    def _keys(self, among: list[str]) -> None:
        for u in among:
            self.advertised[u] = self.clients[u].advertise()
            self.server.add_keys(u, self.advertised[u])
        self.key_list = self.server.close_keys()

    def _shares(self, among: list[str]) -> None:
        for u in among:
            self.sent[u] = self.clients[u].share(self.key_list)
            self.server.add_envelopes(u, self.sent[u])
        self.inboxes = self.server.close_shares()

    def _masked(self, among: list[str]) -> None:
        for u in among:
            self.uploads[u] = self.clients[u].masked_input(self.inboxes[u], self.inputs[u])
            self.server.add_masked(u, self.uploads[u], self.clients[u].masked_signature)
        self.u3 = self.server.close_masked()

    def _consistency(self, among: list[str]) -> None:
        for u in among:
            self.signatures[u] = self.clients[u].consistency(self.u3)
            self.server.add_signature(u, self.signatures[u])
        self.signed = self.server.close_consistency()

    def _unmask(self, among: list[str]) -> None:
        for u in among:
            self.reveals[u] = self.clients[u].unmask(self.signed)
            self.server.add_reveal(u, self.reveals[u])


def flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


def test_vectors_longer_than_one_mask_block_are_masked_throughout_and_cancel_exactly():
    """Masks are applied a cache-sized block at a time: every block, and the short last one, must be masked
    with fresh keystream, and cancel."""
    dropouts = {D: "masked"}  # self masks, pair masks and a rebuilt mask key
    wide, narrow = 2 * BLOCK_BYTES // 8 + 5, 2 * BLOCK_BYTES // 4 + 3  # each part over two blocks and a bit
    bench = Bench(make_spec(4, threshold=3, ring=Ring(wide, narrow)))
    bench.run(dropouts)
    u3 = stage_survivors(bench.spec, dropouts)[2]
    assert np.array_equal(
        bench.server.close_unmask(), ring_sum((bench.inputs[u] for u in u3), bench.spec.ring)
    )
    ring = bench.spec.ring
    for upload, plain in zip(ring.parts(bench.uploads[A]), ring.parts(bench.inputs[A]), strict=True):
        mask, block = upload - plain, BLOCK_BYTES // upload.itemsize
        assert np.count_nonzero(mask == 0) <= 1  # no block left unmasked, the last one included
        assert np.count_nonzero(mask[:block] == mask[block : 2 * block]) <= 1  # no keystream repeated


# --- never both shares of one peer ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "changes", "dropouts"),
    [
        (5, {"threshold": 3}, {B: "masked", D: "consistency"}),
        (6, {"threshold": 4}, {A: "masked", "silo-05": "masked"}),
        (6, {"threshold": 4}, {C: "masked", A: "unmask"}),
        (10, {"neighbours": 4}, {"silo-04": "masked"}),
    ],
    ids=["t=3 of 5", "t=4 of 6, two at masked", "t=4 of 6, one at unmask", "secagg+ n=10 k=4"],
)
def test_no_silo_reveals_both_shares_of_a_peer_and_none_reveals_twice(n, changes, dropouts):
    """Revealing a dropped silo's self-mask share next to its mask-key share would unmask its input."""
    bench = Bench(make_spec(n, **changes))
    bench.run(dropouts)
    summed = bench.server.close_unmask()
    _, u2, u3, _, _ = stage_survivors(bench.spec, dropouts)
    assert set(bench.u3) == u3
    assert u2 - u3  # the test needs a silo whose mask key must be rebuilt
    assert set(bench.reveals) == stage_survivors(bench.spec, dropouts)[4]
    assert np.array_equal(summed, ring_sum((bench.inputs[u] for u in u3), RING))
    for u, reveal in bench.reveals.items():
        mine = bench.spec.graph[u] | {u}
        assert not reveal.self_mask.keys() & reveal.mask_key.keys()
        assert set(reveal.self_mask) == u3 & mine
        assert set(reveal.mask_key) == (u2 - u3) & mine
        with pytest.raises(StageError):
            bench.clients[u].unmask(bench.signed)


# --- a census every silo recomputes ---------------------------------------------------------------------


def census_outcome(spec: SessionSpec, dropouts: Mapping[str, str], seed: int, *, exact: bool = True) -> None:
    """A census (`spec`, a sum silos recompute) under `dropouts`: the aggregator's sum is exact over U3 or
    the session aborts, as for any sum; and every silo of U4 recomputes exactly the aggregator's sum from the
    transcript, those whose reveal never arrived too."""
    bench = Bench(spec)
    bench.inputs = random_words(spec, seed)
    try:
        bench.run(dropouts)
        total = bench.server.close_unmask()
    except TooFewSurvivors:
        assert not completes(spec, dropouts)
        return
    assert completes(spec, dropouts) or not exact
    _, _, u3, u4, u5 = stage_survivors(spec, dropouts)
    assert np.array_equal(total, ring_sum((bench.inputs[u] for u in u3), spec.ring))
    transcript = bench.server.transcript()
    bench.server.close_transcript()
    assert (set(transcript.masked), set(transcript.reveals)) == (u3, u5)
    for u in u4 - u5:  # their reveal was lost on the way; they are still there for the transcript
        bench.clients[u].unmask(bench.signed)
    for u in sorted(u4):
        assert np.array_equal(bench.clients[u].recompute(transcript), total), u


@given(sessions((3, 5, 10)))
@settings(max_examples=60, deadline=None)
def test_a_census_recomputes_at_every_silo_to_the_aggregators_sum_whoever_drops_out(case):
    spec, dropouts, seed = case
    spec = replace(spec, purpose="census")  # the session names its purpose, so it draws its own graph
    event("completes" if completes(spec, dropouts) else "aborts")
    census_outcome(spec, dropouts, seed)


@given(sessions((10, 12), neighbours=4))
@settings(max_examples=25, deadline=None)
def test_a_secagg_plus_census_recomputes_at_every_silo_to_the_aggregators_sum(case):
    spec, dropouts, seed = case
    spec = replace(spec, purpose="census")  # the session names its purpose, so it draws its own graph
    event("completes" if completes(spec, dropouts) else "aborts")
    census_outcome(spec, dropouts, seed, exact=False)


def test_the_aggregator_takes_a_census_masked_input_or_reveal_only_as_its_silo_signed_it():
    bench = Bench(make_spec(4, purpose="census"))
    server, spec = bench.server, bench.server.spec
    bench.run(until="masked")
    masked = bench.clients[A].masked_input(bench.inboxes[A], bench.inputs[A])
    signature = bench.clients[A].masked_signature
    by_b = sign(bench.identities[B], spec.masked_message(A, masked), context=MASKED_CONTEXT)
    for forged in (b"", flip(signature, len(signature) - 1), by_b):
        with pytest.raises(ProtocolViolation, match=f"{A}: signature does not verify"):
            server.add_masked(A, masked, forged)
    with pytest.raises(ProtocolViolation, match=f"{A}: signature does not verify"):
        server.add_masked(A, masked + np.uint8(1), signature)  # another vector under A's signature
    server.add_masked(A, masked, signature)
    bench.run(start="masked", until="unmask")
    reveal = bench.clients[A].unmask(bench.signed)
    altered = replace(reveal, self_mask={**reveal.self_mask, B: flip(reveal.self_mask[B], 3)})
    for forged in (replace(reveal, signature=b""), altered):
        with pytest.raises(ProtocolViolation, match=f"{A}: signature does not verify"):
            server.add_reveal(A, forged)
    server.add_reveal(A, reveal)
    bench.run(start="unmask")
    assert np.array_equal(server.close_unmask(), ring_sum(bench.inputs.values(), spec.ring))


def resigned_reveal(bench: Bench, silo: str, reveal: Reveal) -> Reveal:
    """`reveal` as `silo` signs it: a silo colluding with the aggregator, not a forger."""
    message = bench.server.spec.reveal_message(silo, reveal)
    return replace(reveal, signature=sign(bench.identities[silo], message, context=REVEAL_CONTEXT))


def test_a_silo_recomputes_only_from_what_it_saw_even_with_a_colluding_silo_signing():
    """A colluding silo signs what the aggregator asks; a silo still recomputes only from the survivors it
    signed for, reveals of silos whose consistency signature it verified, each for the right peers."""
    dropouts = {DROPPED: "masked", D: "consistency"}  # U3 without silo-04, U4 without D too
    bench = Bench(make_spec(6, threshold=4, purpose="census"))
    bench.run(dropouts)
    total = bench.server.close_unmask()
    transcript = bench.server.transcript()
    reveals = transcript.reveals
    from_d = resigned_reveal(bench, D, reveals[A])
    with pytest.raises(ProtocolViolation, match=f"reveals from {D}, who signed no consistency signature"):
        bench.clients[A].recompute(replace(transcript, reveals={**reveals, D: from_d}))
    both = Reveal({**reveals[A].self_mask, DROPPED: reveals[A].mask_key[DROPPED]}, reveals[A].mask_key)
    with pytest.raises(ProtocolViolation, match=f"{A} revealed shares for the wrong silos"):
        bench.clients[B].recompute(
            replace(transcript, reveals={**reveals, A: resigned_reveal(bench, A, both)})
        )
    narrowed = {u: m for u, m in transcript.masked.items() if u != D}
    with pytest.raises(ProtocolViolation, match="not those of the survivors this silo signed"):
        bench.clients[C].recompute(replace(transcript, masked=narrowed))
    assert np.array_equal(bench.clients["silo-05"].recompute(transcript), total)


def test_only_a_census_has_a_transcript_stage_and_each_side_takes_it_once_in_order():
    contribution = Bench(make_spec(3))
    contribution.run()
    contribution.server.close_unmask()
    with pytest.raises(StageError, match="no transcript at 'done'"):
        contribution.server.transcript()
    with pytest.raises(StageError, match="asked for stage 'transcript' while at 'done'"):
        contribution.clients[A].recompute(Transcript({}, {}))
    census = Bench(make_spec(3, purpose="census"))
    census.run(until="unmask")
    with pytest.raises(StageError, match="asked for stage 'transcript' while at 'unmask'"):
        census.clients[A].recompute(Transcript({}, {}))
    with pytest.raises(StageError, match="no transcript at 'unmask'"):
        census.server.transcript()
    census.run(start="unmask")
    total = census.server.close_unmask()
    transcript = census.server.transcript()
    census.server.close_transcript()
    assert np.array_equal(census.clients[A].recompute(transcript), total)
    with pytest.raises(StageError, match="asked for stage 'transcript' while at 'done'"):
        census.clients[A].recompute(transcript)
    with pytest.raises(StageError, match="cannot close stage 'transcript'"):
        census.server.close_transcript()


# --- keys: forged, duplicated, missing, foreign -----------------------------------------------------------

FORGERIES: dict[str, Callable[[Bench, AdvertisedKeys], AdvertisedKeys]] = {
    "signed by another silo": lambda b, k: replace(
        k, signature=sign(b.identities[A], b.spec.key_message(k), context=KEYS_CONTEXT)
    ),
    "signature bit flipped": lambda b, k: replace(k, signature=flip(k.signature, len(k.signature) - 1)),
    "keys swapped after signing": lambda b, k: replace(k, c_public=k.s_public, s_public=k.c_public),
    "fresh key under the old signature": lambda b, k: replace(
        k, s_public=crypto.public_bytes(crypto.new_private_key())
    ),
    "signed for the consistency round": lambda b, k: replace(
        k, signature=sign(b.identities[k.silo], b.spec.key_message(k), context=CONSISTENCY_CONTEXT)
    ),
    "signed for the census sum": lambda b, k: replace(
        k,
        signature=sign(
            b.identities[k.silo], replace(b.spec, purpose="census").key_message(k), context=KEYS_CONTEXT
        ),
    ),
    "no signature": lambda b, k: replace(k, signature=b""),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_key_signatures_are_refused_by_silos_and_the_aggregator(forgery):
    bench = Bench(make_spec(3))
    bench.run(until="shares")
    forged = FORGERIES[forgery](bench, bench.advertised[B])
    key_list = [forged if k.silo == B else k for k in bench.key_list]
    with pytest.raises(ProtocolViolation, match=f"{B}: signature does not verify"):
        bench.clients[C].share(key_list)

    fresh = Bench(make_spec(3))
    genuine = fresh.clients[B].advertise()
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        fresh.server.add_keys(B, FORGERIES[forgery](fresh, genuine))
    fresh.server.add_keys(B, genuine)  # the refusal left no trace: the genuine keys still go through


# what the copycat changes in its own keys, given the peer's
DUPLICATES: dict[str, Callable[[AdvertisedKeys], dict[str, bytes]]] = {
    "a peer's key exchange key": lambda peer: {"c_public": peer.c_public},
    "a peer's mask key": lambda peer: {"s_public": peer.s_public},
    "a peer's mask key as key exchange key": lambda peer: {"c_public": peer.s_public},
}


@pytest.mark.parametrize("copied", DUPLICATES)
def test_a_public_key_another_silo_advertised_is_refused(copied):
    """A silo re-advertising a peer's key (with its own valid signature) could read that peer's envelopes or
    cancel its masks; the silos and the aggregator refuse it."""
    bench = Bench(make_spec(3))
    bench.run(until="shares")
    a, b, c = bench.key_list
    copycat = bench.resigned(b, **DUPLICATES[copied](a))
    with pytest.raises(ProtocolViolation, match=f"{B} advertises a public key that is already in use"):
        bench.clients[C].share([a, copycat, c])

    fresh = Bench(make_spec(3))
    first = fresh.clients[A].advertise()
    fresh.server.add_keys(A, first)
    theirs = fresh.resigned(fresh.clients[B].advertise(), **DUPLICATES[copied](first))
    with pytest.raises(ProtocolViolation, match=f"{B} advertised a public key another silo already uses"):
        fresh.server.add_keys(B, theirs)


def test_one_key_for_both_purposes_or_two_key_sets_for_one_silo_are_refused_by_silos():
    bench = Bench(make_spec(3))
    bench.run(until="shares")
    a, b, c = bench.key_list
    with pytest.raises(ProtocolViolation, match="one key for both purposes"):
        bench.clients[C].share([a, bench.resigned(b, s_public=b.c_public), c])
    second = Bench(make_spec(3), identities=bench.identities).clients[B].advertise()  # B's, validly signed
    with pytest.raises(ProtocolViolation, match=f"two key sets for {B}"):
        bench.clients[A].share([a, b, second, c])


OWN_KEYS: dict[str, Callable[[Bench, list[AdvertisedKeys]], list[AdvertisedKeys]]] = {
    "left out": lambda bench, keys: [k for k in keys if k.silo != A],
    "an empty list": lambda bench, keys: [],
    "swapped, re-signed by the silo": lambda bench, keys: [
        bench.resigned(k, c_public=k.s_public, s_public=k.c_public) if k.silo == A else k for k in keys
    ],
    "the silo's keys from a parallel session": lambda bench, keys: [
        Bench(bench.spec, identities=bench.identities).clients[A].advertise() if k.silo == A else k
        for k in keys
    ],
}


@pytest.mark.parametrize("change", OWN_KEYS)
def test_a_key_list_without_the_silos_own_keys_unchanged_is_refused(change):
    """An aggregator that swaps a silo's keys could open the shares sealed to it."""
    bench = Bench(make_spec(3))
    bench.run(until="shares")
    with pytest.raises(ProtocolViolation, match="does not carry this silo's own keys unchanged"):
        bench.clients[A].share(OWN_KEYS[change](bench, bench.key_list))


def test_keys_from_outside_the_session_or_in_another_silos_name_are_refused():
    bench = Bench(make_spec(3))
    bench.run(until="shares")
    outsider_identity = ec.generate_private_key(ec.SECP256R1())
    outsider = replace(bench.key_list[2], silo="intruder")
    outsider = replace(
        outsider, signature=sign(outsider_identity, bench.spec.key_message(outsider), context=KEYS_CONTEXT)
    )
    with pytest.raises(ProtocolViolation, match="keys from 'intruder', who is not a participant"):
        bench.clients[A].share([*bench.key_list, outsider])

    fresh = Bench(make_spec(3))
    with pytest.raises(StageError, match="intruder is not expected at stage 'keys'"):
        fresh.server.add_keys("intruder", outsider)
    with pytest.raises(ProtocolViolation, match=f"{B} advertised keys in the name of {A}"):
        fresh.server.add_keys(B, fresh.clients[A].advertise())


def mask_with_peer_keys(bench: Bench, changes: Mapping[str, bytes]) -> np.ndarray:
    """A takes B's keys changed by `changes` (validly signed by B) and goes on to mask its input from the
    peers' genuine shares: both places where a peer's public keys are used."""
    genuine = [bench.clients[u].advertise() for u in bench.spec.participants]
    taken = [bench.resigned(k, **changes) if k.silo == B else k for k in genuine]
    sent = {u: bench.clients[u].share(taken if u == A else genuine) for u in bench.spec.participants}
    inbox = Inbox(bench.spec.participants, tuple(e for es in sent.values() for e in es if e.recipient == A))
    return bench.clients[A].masked_input(inbox, bench.inputs[A])


UNUSABLE_KEYS = {
    "all-zero key exchange key": {"c_public": bytes(32)},
    "short key exchange key": {"c_public": bytes(31)},
    "all-zero mask key": {"s_public": bytes(32)},
    "empty mask key": {"s_public": b""},
}


def test_a_peers_genuine_keys_pass_the_helper_used_below():
    """Control for the next test: with B's keys unchanged (re-signed) A masks its input."""
    masked = mask_with_peer_keys(Bench(make_spec(3)), {})
    assert masked.shape == (RING.nbytes,)


@pytest.mark.parametrize("unusable", UNUSABLE_KEYS)
def test_a_peers_unusable_x25519_key_is_a_protocol_violation(unusable):
    """A correctly signed key that is not an X25519 point breaks the protocol like a duplicated one does."""
    with pytest.raises(ProtocolViolation):
        mask_with_peer_keys(Bench(make_spec(3)), UNUSABLE_KEYS[unusable])


@pytest.mark.parametrize("unusable", [*UNUSABLE_KEYS, "one key for both purposes"])
def test_the_aggregator_refuses_keys_no_silo_can_use(unusable):
    bench = Bench(make_spec(3))
    keys = bench.clients[B].advertise()
    changes = UNUSABLE_KEYS.get(unusable, {"s_public": keys.c_public})
    with pytest.raises(ProtocolViolation):
        bench.server.add_keys(B, bench.resigned(keys, **changes))


# --- envelopes -------------------------------------------------------------------------------------------

SENT_BY_A: dict[str, Callable[[list[Envelope]], list[Envelope]]] = {
    "sender renamed": lambda es: [replace(e, sender=B) for e in es],
    "two envelopes for one holder": lambda es: [replace(e, recipient=es[0].recipient) for e in es],
    "one holder left out": lambda es: es[1:],
    "an envelope sealed to itself": lambda es: [*es, replace(es[0], recipient=A)],
    "an envelope for an outsider": lambda es: [*es, replace(es[0], recipient="intruder")],
    "one envelope twice": lambda es: [*es, es[0]],
}


@pytest.mark.parametrize("tamper", SENT_BY_A)
def test_the_aggregator_takes_exactly_one_envelope_from_a_silo_to_each_of_its_holders(tamper):
    bench = Bench(make_spec(4))
    bench.run(until="shares")
    envelopes = bench.clients[A].share(bench.key_list)
    with pytest.raises(ProtocolViolation, match=f"{A} must send one envelope to each of"):
        bench.server.add_envelopes(A, SENT_BY_A[tamper](envelopes))
    bench.server.add_envelopes(A, envelopes)


def swap_from(inbox: Inbox, sender: str, envelope: Envelope) -> Inbox:
    return Inbox(inbox.survivors, tuple(envelope if e.sender == sender else e for e in inbox.envelopes))


def sealed(bench: Bench, sender: str, recipient: str) -> Envelope:
    """The envelope `sender` sealed for `recipient` at the shares stage."""
    return next(e for e in bench.sent[sender] if e.recipient == recipient)


def tampered_envelope(where: Callable[[bytes], bytes]) -> Callable[[Bench], Inbox]:
    def tamper(bench: Bench) -> Inbox:
        genuine = sealed(bench, A, C)
        return swap_from(bench.inboxes[C], A, replace(genuine, ciphertext=where(genuine.ciphertext)))

    return tamper


# each makes C's inbox (after the shares stage) tampered, and names the refusal it must meet
INBOXES: dict[str, tuple[Callable[[Bench], Inbox], str]] = {
    "A's envelope for B handed to C": (
        lambda b: swap_from(b.inboxes[C], A, sealed(b, A, B)),
        f"an envelope from {A} to {B} is misrouted",
    ),
    "A's envelope for C relabelled as B's": (
        lambda b: swap_from(b.inboxes[C], B, replace(sealed(b, A, C), sender=B)),
        f"envelope from {B}: envelope fails authentication",
    ),
    "A's envelope for B relabelled for C": (
        lambda b: swap_from(b.inboxes[C], A, replace(sealed(b, A, B), recipient=C)),
        f"envelope from {A}: envelope fails authentication",
    ),
    "C's own envelope to A reflected back": (
        lambda b: swap_from(b.inboxes[C], A, replace(sealed(b, C, A), sender=A, recipient=C)),
        f"envelope from {A}: envelope fails authentication",
    ),
    "nonce bit flipped": (tampered_envelope(lambda c: flip(c, 0)), "fails authentication"),
    "ciphertext bit flipped": (tampered_envelope(lambda c: flip(c, 40)), "fails authentication"),
    "tag bit flipped": (tampered_envelope(lambda c: flip(c, len(c) - 1)), "fails authentication"),
    "truncated": (tampered_envelope(lambda c: c[:20]), "envelope too short"),
    "an envelope from an outsider": (
        lambda b: swap_from(b.inboxes[C], A, replace(sealed(b, A, C), sender="intruder")),
        "an envelope from intruder to silo-02 is misrouted",
    ),
    "one envelope twice": (
        lambda b: Inbox(b.inboxes[C].survivors, (*b.inboxes[C].envelopes, sealed(b, A, C))),
        f"a second envelope from {A}",
    ),
    "one envelope withheld": (
        lambda b: Inbox(b.inboxes[C].survivors, tuple(e for e in b.inboxes[C].envelopes if e.sender != A)),
        f"no shares from {A}, though they are listed as survivors",
    ),
    "a survivor that advertised no keys": (
        lambda b: Inbox((*b.inboxes[C].survivors, "intruder"), b.inboxes[C].envelopes),
        "names silos that advertised no keys",
    ),
    "a survivor list without the silo": (
        lambda b: Inbox(tuple(u for u in b.inboxes[C].survivors if u != C), b.inboxes[C].envelopes),
        "omits this silo",
    ),
}


@pytest.mark.parametrize("tamper", INBOXES)
def test_misrouted_relabelled_or_tampered_envelopes_are_refused_by_the_silo(tamper):
    make_inbox, refusal = INBOXES[tamper]
    bench = Bench(make_spec(4))
    bench.run(until="masked")
    with pytest.raises(ProtocolViolation, match=refusal):
        bench.clients[C].masked_input(make_inbox(bench), bench.inputs[C])


# --- replay from another session ---------------------------------------------------------------------------


def twin_sessions(monkeypatch: pytest.MonkeyPatch, **later: str) -> tuple[Bench, Bench]:
    """Two sessions of the same silos with the same identities and even the same X25519 keys, the second
    differing only by `later` (its round or its purpose): whatever it refuses, it refuses for the binding."""
    made: list[crypto.X25519PrivateKey] = []
    real = crypto.new_private_key

    def recording() -> crypto.X25519PrivateKey:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(crypto, "new_private_key", recording)
    earlier = Bench(make_spec(3))
    reused = iter(made)
    monkeypatch.setattr(crypto, "new_private_key", lambda: next(reused))
    now = Bench(replace(earlier.spec, **later), identities=earlier.identities)
    monkeypatch.setattr(crypto, "new_private_key", real)
    return earlier, now


LATER = {"a later round": {"round_id": "r4.a1"}, "the round's other sum": {"purpose": "census"}}


@pytest.mark.parametrize("later", LATER.values(), ids=LATER)
def test_keys_replayed_into_another_session_are_refused(monkeypatch, later):
    earlier, now = twin_sessions(monkeypatch, **later)
    earlier.run(until="shares")
    now.run(until="shares")
    public = [(k.c_public, k.s_public) for k in now.key_list]
    assert public == [(k.c_public, k.s_public) for k in earlier.key_list]  # only the session differs
    with pytest.raises(ProtocolViolation, match=f"{A}: signature does not verify"):
        now.clients[A].share(earlier.key_list)
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        SecAggServer(now.spec, peers=now.peers).add_keys(B, earlier.advertised[B])


@pytest.mark.parametrize("later", LATER.values(), ids=LATER)
def test_envelopes_replayed_into_another_session_fail_authentication(monkeypatch, later):
    earlier, now = twin_sessions(monkeypatch, **later)
    earlier.run(until="masked")
    now.run(until="masked")
    replayed = Inbox(now.inboxes[C].survivors, earlier.inboxes[C].envelopes)
    with pytest.raises(ProtocolViolation, match="envelope fails authentication"):
        now.clients[C].masked_input(replayed, now.inputs[C])


@pytest.mark.parametrize("later", LATER.values(), ids=LATER)
def test_consistency_signatures_replayed_into_another_session_are_refused(monkeypatch, later):
    earlier, now = twin_sessions(monkeypatch, **later)
    earlier.run(until="unmask")
    now.run(until="consistency")
    assert now.u3 == earlier.u3  # the same survivors: only the session differs
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        now.server.add_signature(B, earlier.signatures[B])
    signatures = {u: now.clients[u].consistency(now.u3) for u in now.u3}
    with pytest.raises(ProtocolViolation, match=f"{B} signed a different view"):
        now.clients[A].unmask(signatures | {B: earlier.signatures[B]})


# --- split views at the consistency round ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shown_to_d", "refusal"),
    [
        (lambda signatures: signatures, "consistency signatures from silos outside the survivor set"),
        (lambda signatures: {u: s for u, s in signatures.items() if u != A}, f"{B} signed a different view"),
    ],
    ids=["every signature", "without the dropped silo's"],
)
def test_a_silo_told_a_survivor_dropped_while_others_count_it_reveals_nothing(shown_to_d, refusal):
    """The aggregator tells D that A dropped, to get A's mask-key share from D while the others give A's
    self-mask shares; the signed views expose the split before anyone reveals."""
    bench = Bench(make_spec(4))
    bench.run(until="consistency")
    narrowed = tuple(u for u in bench.u3 if u != A)
    signatures = {u: bench.clients[u].consistency(bench.u3) for u in (A, B, C)}
    signatures[D] = bench.clients[D].consistency(narrowed)
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        bench.server.add_signature(D, signatures[D])
    for u in (A, B, C):
        with pytest.raises(ProtocolViolation, match=f"{D} signed a different view"):
            bench.clients[u].unmask(signatures)
    with pytest.raises(ProtocolViolation, match=refusal):
        bench.clients[D].unmask(shown_to_d(signatures))


def test_silos_shown_different_models_refuse_to_unmask():
    """Two specs differing only in the state digest they bind: D trained on another model than the rest."""
    bench = Bench(make_spec(4, binding=b"state digest 1"))
    bench.clients[D] = bench.client(D, replace(bench.spec, binding=b"state digest 2"))
    bench.run(until="consistency")  # keys, shares and masks do not depend on the binding
    signatures = {u: client.consistency(bench.u3) for u, client in bench.clients.items()}
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        bench.server.add_signature(D, signatures[D])
    for u, client in bench.clients.items():
        odd_one_out = A if u == D else D
        with pytest.raises(ProtocolViolation, match=f"{odd_one_out} signed a different view"):
            client.unmask(signatures)


# --- the aggregator's stage discipline ---------------------------------------------------------------------


def genuine_message(bench: Bench, stage: str, u: str) -> object:
    """What silo u's client sends at `stage`, from what the bench's aggregator sent out last."""
    client = bench.clients[u]
    return {
        "keys": lambda: client.advertise(),
        "shares": lambda: client.share(bench.key_list),
        "masked": lambda: client.masked_input(bench.inboxes[u], bench.inputs[u]),
        "consistency": lambda: client.consistency(bench.u3),
        "unmask": lambda: client.unmask(bench.signed),
    }[stage]()


def submit(bench: Bench, stage: str, u: str, message: object) -> None:
    server = bench.server
    adders = {
        "keys": server.add_keys,
        "shares": server.add_envelopes,
        "masked": server.add_masked,
        "consistency": server.add_signature,
        "unmask": server.add_reveal,
    }
    adders[stage](u, message)


PLACEHOLDERS = {
    "keys": AdvertisedKeys(A, b"c" * 32, b"s" * 32, b""),
    "shares": [],
    "masked": RING.zeros(),
    "consistency": b"",
    "unmask": Reveal({}, {}),
}

# a second, well-formed message that differs from the silo's first one at that stage
OTHER_MESSAGE: dict[str, Callable[[Bench, str, object], object]] = {
    "keys": lambda b, u, m: Bench(b.spec, identities=b.identities).clients[u].advertise(),
    "shares": lambda b, u, m: [replace(m[0], ciphertext=flip(m[0].ciphertext, 20)), *m[1:]],
    "masked": lambda b, u, m: m + np.uint8(1),
    "consistency": lambda b, u, m: b.signer(u)(b.spec.consistency_message(b.u3), context=CONSISTENCY_CONTEXT),
    "unmask": lambda b, u, m: Reveal({**m.self_mask, u: flip(m.self_mask[u], 5)}, m.mask_key),
}


@pytest.mark.parametrize("stage", STAGES)
def test_the_aggregator_takes_one_message_per_silo_and_stage(stage):
    """Out of turn or from a silo that left: StageError; a resend is taken once; a different second message
    is a violation; and none of these leaves a trace in the sum."""
    i = STAGES.index(stage)
    dropouts = {D: STAGES[i - 1]} if i else {}
    bench = Bench(make_spec(4, threshold=3))
    bench.run(dropouts, until=stage)
    for elsewhere in STAGES:
        if elsewhere != stage:
            with pytest.raises(StageError, match=f"is at {stage!r}, not {elsewhere!r}"):
                submit(bench, elsewhere, A, PLACEHOLDERS[elsewhere])
    latecomer = D if i else "intruder"
    with pytest.raises(StageError, match=f"{latecomer} is not expected at stage {stage!r}"):
        submit(bench, stage, latecomer, PLACEHOLDERS[stage])
    message = genuine_message(bench, stage, A)
    submit(bench, stage, A, message)
    submit(bench, stage, A, message)  # the same message again, as after a reconnect
    other = OTHER_MESSAGE[stage](bench, A, message)
    assert repr(other) != repr(message)
    with pytest.raises(ProtocolViolation, match=f"{A} already"):
        submit(bench, stage, A, other)
    bench.run(dropouts, start=stage)
    u3 = stage_survivors(bench.spec, dropouts)[2]
    assert np.array_equal(bench.server.close_unmask(), ring_sum((bench.inputs[u] for u in u3), RING))


TOO_FEW = {
    "keys": "keys: 2 silos left, the threshold is 3",
    "shares": "shares: 2 silos left, the threshold is 3",
    "masked": "masked input: 2 silos left, the threshold is 3",
    "consistency": "consistency: 2 signatures, the threshold is 3",
    "unmask": "unmask: 2 shares for silo-00's seed, the threshold is 3",
}


@pytest.mark.parametrize("stage", STAGES)
def test_the_aggregator_closes_no_stage_with_fewer_than_t_silos(stage):
    """The aggregator's own count, whatever the silos check: t - 1 answers end the session."""
    bench = Bench(make_spec(4, threshold=3))
    bench.run(until=stage)
    for u in (A, B):
        submit(bench, stage, u, genuine_message(bench, stage, u))
    server = bench.server
    closers = {
        "keys": server.close_keys,
        "shares": server.close_shares,
        "masked": server.close_masked,
        "consistency": server.close_consistency,
        "unmask": server.close_unmask,
    }
    with pytest.raises(TooFewSurvivors, match=TOO_FEW[stage]):
        closers[stage]()


DROPPED = "silo-04"
REVEALS: dict[str, Callable[[Reveal], Reveal]] = {
    "both kinds for the dropped silo": lambda r: Reveal(
        {**r.self_mask, DROPPED: r.mask_key[DROPPED]}, r.mask_key
    ),
    "a survivor's self-mask share left out": lambda r: Reveal(
        {o: s for o, s in r.self_mask.items() if o != B}, r.mask_key
    ),
    "a survivor's mask key": lambda r: Reveal(r.self_mask, {**r.mask_key, B: r.self_mask[B]}),
    "the dropped silo's mask key left out": lambda r: Reveal(r.self_mask, {}),
    "an outsider's share": lambda r: Reveal({**r.self_mask, "intruder": r.self_mask[B]}, r.mask_key),
    "kinds swapped": lambda r: Reveal(dict(r.mask_key), dict(r.self_mask)),
}


@pytest.mark.parametrize("tamper", REVEALS)
def test_a_reveal_for_the_wrong_silos_is_refused(tamper):
    dropouts = {DROPPED: "masked"}
    bench = Bench(make_spec(5, threshold=3))
    bench.run(dropouts, until="unmask")
    reveal = bench.clients[A].unmask(bench.signed)
    with pytest.raises(ProtocolViolation, match=f"{A} revealed shares for the wrong silos"):
        bench.server.add_reveal(A, REVEALS[tamper](reveal))
    bench.server.add_reveal(A, reveal)
    bench.run(dropouts, start="unmask")
    u3 = stage_survivors(bench.spec, dropouts)[2]
    assert np.array_equal(bench.server.close_unmask(), ring_sum((bench.inputs[u] for u in u3), RING))


SPARE_SHARE = {DROPPED: "masked"}  # four holders answer at unmask, t = 3
NO_SPARE_SHARE = {DROPPED: "masked", D: "unmask"}  # exactly t answer: no share to cross-check


def random_share(share: bytes) -> bytes:
    return secrets.randbelow(shamir.PRIME).to_bytes(SHARE_BYTES, "big")


def off_by_one(share: bytes) -> bytes:
    return flip(share, SHARE_BYTES - 1)


@pytest.mark.parametrize(
    ("dropouts", "kind", "owner", "corrupt", "refusal"),
    [
        *(
            pytest.param(dropouts, *case, id=f"{case_id}, {regime}")
            for regime, dropouts in (("spare share", SPARE_SHARE), ("no spare share", NO_SPARE_SHARE))
            for case_id, case in {
                "random self-mask share": ("self_mask", B, random_share, f"shares of {B}'s seed"),
                "mask-key share off by one": ("mask_key", DROPPED, off_by_one, DROPPED),
                "short self-mask share": (
                    "self_mask",
                    C,
                    lambda s: s[:-1],
                    f"a share has {SHARE_BYTES} bytes",
                ),
            }.items()
        ),
        # with a spare share even a small change is caught (the shares no longer lie on one polynomial)
        pytest.param(
            SPARE_SHARE, "self_mask", B, off_by_one, "inconsistent or tampered", id="self-mask off by one"
        ),
    ],
)
def test_a_corrupted_share_aborts_the_unmasking_instead_of_giving_a_wrong_sum(
    dropouts, kind, owner, corrupt, refusal
):
    bench = Bench(make_spec(5, threshold=3))
    bench.run(dropouts, until="unmask")
    reveal = bench.clients[A].unmask(bench.signed)
    shares = dict(getattr(reveal, kind))
    shares[owner] = corrupt(shares[owner])
    bench.server.add_reveal(A, replace(reveal, **{kind: shares}))
    bench.run(dropouts, start="unmask")
    with pytest.raises(ProtocolViolation, match=refusal):
        bench.server.close_unmask()


# --- the silo's stage discipline ----------------------------------------------------------------------------


def test_a_silo_runs_each_stage_once_and_in_order():
    bench = Bench(make_spec(3))
    client = bench.clients[A]
    with pytest.raises(StageError, match="asked for stage 'shares' while at 'keys'"):
        client.share([])
    with pytest.raises(StageError, match="asked for stage 'unmask' while at 'keys'"):
        client.unmask({})
    client.advertise()
    with pytest.raises(StageError, match="asked for stage 'keys' while at 'shares'"):
        client.advertise()
    with pytest.raises(SecAggError, match=r"intruder is not a participant of r3\.a1"):
        SecAggClient(bench.spec, "intruder", sign=bench.signer(A), peers=bench.peers)


VIOLATIONS: dict[str, Callable[[Bench], object]] = {
    "shares": lambda b: b.clients[A].share(b.key_list[1:]),
    "masked": lambda b: b.clients[A].masked_input(Inbox(b.inboxes[A].survivors, ()), b.inputs[A]),
    "consistency": lambda b: b.clients[A].consistency((*b.u3, "intruder")),
}
LATER_CALLS: dict[str, Callable[[Bench], object]] = {
    "masked": lambda b: b.clients[A].masked_input(
        Inbox(
            tuple(sorted({A, *b.server.u2})),
            tuple(e for es in b.sent.values() for e in es if e.recipient == A),
        ),
        b.inputs[A],
    ),
    "consistency": lambda b: b.clients[A].consistency(tuple(sorted({A, *b.u3}))),
    "unmask": lambda b: b.clients[A].unmask(b.signed),
}


@pytest.mark.parametrize("stage", VIOLATIONS)
def test_a_silo_that_saw_a_violation_takes_no_further_part(stage):
    """Once a silo refuses a message it must not be talked into masking, signing or revealing later on."""
    dropouts = {A: stage}
    bench = Bench(make_spec(4, threshold=3))
    bench.run(until=stage)
    with pytest.raises(ProtocolViolation):
        VIOLATIONS[stage](bench)
    bench.run(dropouts, start=stage)  # the others finish without A
    u3 = stage_survivors(bench.spec, dropouts)[2]
    assert np.array_equal(bench.server.close_unmask(), ring_sum((bench.inputs[u] for u in u3), RING))
    for later in STAGES[STAGES.index(stage) + 1 :]:
        with pytest.raises(SecAggError):
            LATER_CALLS[later](bench)


@pytest.mark.parametrize(
    ("survivors", "error", "refusal"),
    [
        (lambda u3: (*u3, "intruder"), ProtocolViolation, "not a subset of the earlier survivors"),
        (lambda u3: u3[1:], ProtocolViolation, "not a subset of the earlier survivors"),  # without A
        (lambda u3: (*u3, u3[1]), ProtocolViolation, "not a subset of the earlier survivors"),
        (lambda u3: u3[:2], TooFewSurvivors, "masked input: 2 silos left, the threshold is 3"),
    ],
    ids=["an outsider", "without the silo", "a survivor twice", "below the threshold"],
)
def test_a_silo_signs_only_a_plausible_survivor_list(survivors, error, refusal):
    bench = Bench(make_spec(4, threshold=3))
    bench.run(until="consistency")
    with pytest.raises(error, match=refusal):
        bench.clients[A].consistency(survivors(bench.u3))


@pytest.mark.parametrize(
    ("signers", "error", "refusal"),
    [
        ((A, B), TooFewSurvivors, "consistency: 2 signatures, the threshold is 3"),
        ((B, C, D), ProtocolViolation, "outside the survivor set"),
    ],
    ids=["below the threshold", "without its own"],
)
def test_a_silo_reveals_only_with_enough_signatures_including_its_own(signers, error, refusal):
    bench = Bench(make_spec(4, threshold=3))
    bench.run(until="unmask")
    with pytest.raises(error, match=refusal):
        bench.clients[A].unmask({u: bench.signed[u] for u in signers})


# --- what one masked upload shows --------------------------------------------------------------------------

UPLOAD_WORDS = 20_000
PLAINTEXTS = {  # (ring, the plaintext's words): the wide part and the narrow part, each on its own
    "zeros, wide": (Ring(UPLOAD_WORDS), np.zeros(UPLOAD_WORDS, dtype="<u8")),
    "ramp in the high bits, wide": (
        Ring(UPLOAD_WORDS),
        np.arange(UPLOAD_WORDS, dtype="<u8") << np.uint64(47),
    ),
    "zeros, narrow": (Ring(0, UPLOAD_WORDS), np.zeros(UPLOAD_WORDS, dtype="<u4")),
    "ramp in the high bits, narrow": (
        Ring(0, UPLOAD_WORDS),
        np.arange(UPLOAD_WORDS, dtype="<u4") << np.uint32(17),
    ),
}


def chi_square_of_top_byte(words: np.ndarray) -> float:
    top = (words >> (8 * words.itemsize - 8)).astype(np.int64)
    counts = np.bincount(top, minlength=256)
    expected = len(words) / 256
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("plaintext", PLAINTEXTS)
def test_one_masked_upload_looks_uniform_and_unrelated_to_its_input(plaintext):
    """The aggregator sees each upload alone: it must be indistinguishable from noise."""
    ring, plain = PLAINTEXTS[plaintext]
    bench = Bench(make_spec(3, ring=ring))
    bench.inputs = {u: plain.view(np.uint8) for u in bench.spec.participants}
    bench.run(until="consistency")
    upload, neighbour = (bench.uploads[u].view(plain.dtype) for u in (A, B))
    assert np.count_nonzero(upload == plain) <= 1  # a 32-bit word may match by chance: P ≈ 20,000 / 2^32
    assert chi_square_of_top_byte(plain) > 340  # the plaintext itself fails the test...
    assert chi_square_of_top_byte(upload) < 340  # ...the upload passes (255 dof: P(chi2 > 340) < 0.001)
    if plain.std() > 0:
        assert abs(np.corrcoef(upload.astype(np.float64), plain.astype(np.float64))[0, 1]) < 0.05
    assert abs(np.corrcoef(upload.astype(np.float64), neighbour.astype(np.float64))[0, 1]) < 0.05


# --- settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"threshold": 2}, "threshold 2 must be a majority of each seed's 4 holders"),
        ({"threshold": 1}, "must be a majority"),
        ({"threshold": -1}, "must be a majority"),
        ({"threshold": 5}, "and at most 4"),
        ({"neighbours": 3}, "neighbours must be even and >= 0, got 3"),
        ({"neighbours": -2}, "neighbours must be even and >= 0, got -2"),
        ({"participants": (B, A, C, D)}, "distinct, sorted silo ids"),
        ({"participants": (A, A, B, C)}, "distinct, sorted silo ids"),
        ({"participants": (A,)}, "at least two"),
        ({"purpose": "gossip"}, "unknown purpose 'gossip'"),
    ],
)
def test_a_session_spec_refuses_unsafe_or_malformed_settings(changes, refusal):
    with pytest.raises(SecAggError, match=refusal):
        make_spec(4, **changes)


def test_a_threshold_must_be_a_strict_majority_of_a_seeds_holders():
    """With t <= m/2 two disjoint halves of a seed's holders could each rebuild it."""
    for n in range(2, 13):
        for threshold in range(1, n + 2):
            accepted = 2 * threshold > n and threshold <= n
            if accepted:
                assert make_spec(n, threshold=threshold).t == threshold
            else:
                with pytest.raises(SecAggError, match="majority"):
                    make_spec(n, threshold=threshold)
    # SecAgg+: the holders are a silo and its 4 neighbours, whatever n is
    assert [make_spec(12, neighbours=4, threshold=t).t for t in (3, 4, 5)] == [3, 4, 5]
    for threshold in (2, 6):
        with pytest.raises(SecAggError, match="majority of each seed's 5 holders"):
            make_spec(12, neighbours=4, threshold=threshold)


def test_the_default_threshold_is_more_than_two_thirds_and_at_least_two():
    assert [default_threshold(m) for m in (2, 3, 4, 5, 10)] == [2, 3, 3, 4, 7]
    for m in range(2, 100):
        t = default_threshold(m)
        assert 3 * t > 2 * m
        assert 2 <= t <= m
        assert t == 2 or 3 * (t - 1) <= 2 * m  # and no more than that
    assert make_spec(10).t == 7
    assert make_spec(12, neighbours=4).t == default_threshold(5) == 4
    assert make_spec(5, neighbours=4).t == default_threshold(5)  # 4 neighbours of 5 silos: complete


# --- the layer ----------------------------------------------------------------------------------------------

LAYER_SCHEMA = Schema(
    (
        Field("delta", (4, 6), 5.0, frac_bits=22, per_class=True),
        Field("bias", (5,), 5.0, frac_bits=16),
        Field("n", (), 1e4, frac_bits=0),
    )
)


@pytest.mark.parametrize(
    "layer",
    [lambda: make_layer("secagg"), lambda: SecAggSum(SecAggSettings(neighbours=2))],
    ids=["default", "secagg+ ring"],
)
def test_the_secagg_layer_gives_the_plaintext_sums_within_the_codec_bound(layer):
    generator = torch.Generator().manual_seed(4)
    contributions = [
        LAYER_SCHEMA.contribution(
            delta=torch.randn(4, 6, generator=generator, dtype=torch.float64),
            bias=3 * torch.randn(5, generator=generator, dtype=torch.float64),
            n=float(10 * k + 3),
        )
        for k in range(6)
    ]
    secure, plain = (
        layer().aggregate(LAYER_SCHEMA, contributions),
        make_layer("plaintext").aggregate(LAYER_SCHEMA, contributions),
    )
    assert secure.contributors == plain.contributors == 6
    for f in LAYER_SCHEMA.fields:
        assert (secure[f.name] - plain[f.name]).abs().max().item() <= 6 * 2.0**-f.frac_bits, f.name
