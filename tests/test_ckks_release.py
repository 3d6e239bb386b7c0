"""What a ckks silo releases after decrypting, and what the aggregator keeps for it, probed as a hostile
aggregator would probe them.

Under ckks only silos read sums, so they step the model, seal the next state for the aggregator to keep, and
report the evaluation counts they decrypt. The aggregator chooses every ciphertext a silo decrypts and every
byte it streams back, so it can hand one silo's evaluation upload over as "the sum", replay or alter a sealed
state, make up a first state, or relay a key nobody may share. Each attack is first shown to work where the
check it meets is absent (no masks, ChaCha20 without its tag, no seed check, a relay naming the attacker),
then the check is shown to stop it.

The silos step with the real `step_and_report` (FedAvg's cnn-small from tests/consortium_harness.py, from a
made-up contribution sum), so every evaluation upload here is one a silo would send.

The consistency step (every silo signs the ciphertext it was handed, and decrypts only once every silo of the
sum signed the same one) is shown in tests/test_ckks_consistency.py; here the aggregator hands every silo the
same crafted ciphertext, which that step lets through, so the masks alone stand between it and one silo's
counts. They are bound to the state each silo stepped to, not only to the round_id the aggregator signs and
may reuse, so uploads of rounds that reuse one round_id do not combine into mask-free counts of one silo.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import tenseal as ts
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.held_state import HeldState
from aggregator.key_service import KeyServiceRelay
from fedlt.aggregation import SumLayer, record
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate
from fedlt.aggregation.halves import BadMessage, SumAborted, SumSpec, evaluation_schema
from fedlt.data.arrays import LabeledData
from fedlt.errors import FedltError
from fedlt.methods import ServerContext
from fedlt.methods.state import GlobalState, pack_state, unpack_state
from fedlt.v1 import round_pb2
from privacy.ckks.halves import (
    CkksAggregatorSide,
    CkksSiloSide,
    EncryptedSum,
    EncryptedUpload,
    SumSignatures,
)
from privacy.ckks.keys import Ciphertext, SecretContext
from privacy.keyservice.ceremony import SealedContext
from privacy.keyservice.relay import NoKeyYet
from privacy.peers import ConsistencySignature, Signed
from privacy.stepping.attestation import Attestation, Attested, attest
from privacy.stepping.masks import MASK_RANGE, zero_sum_mask
from privacy.stepping.sealed_state import NONCE, STATE_INFO, SealedStateError, open_state, seal_state
from privacy.wire import upload_of
from silo.key_service import Keyring
from silo.stepping import StateRefused, evaluation_counts, opened_state, report_evaluation, step_and_report
from silo.transport import SiloTransport
from tests.consortium_harness import PLAN
from tests.test_ckks import PEERS, SECRET, signer
from tests.test_ckks_ceremony import CONSORTIUM, HOLDER, ME, OTHER
from tests.test_ckks_ceremony import consortium as consortium  # the roster's CA and silos (module-scoped)
from tests.test_ckks_ceremony import run as run  # HOLDER's key sealed to ME and OTHER (module-scoped)
from tests.test_roster import pem

METHOD = PLAN.build_method()
CLASSES = METHOD.model_spec.num_classes
SEED = 7
START = METHOD.init_state(seed=SEED)
SILOS = ("a", "b", "c", "d")
VICTIM, READER = "a", "c"  # whose counts the aggregator is after; who it hands a ciphertext to
SIDES = {silo: CkksSiloSide(lambda _: SECRET, sign=signer(silo), peers=PEERS) for silo in SILOS}
AGGREGATOR = CkksAggregatorSide(SECRET.public)


def held_out(silo: str) -> LabeledData:
    """Each silo's own test slice: random images, labels skewed its own way (what the masks must hide)."""
    rng = np.random.default_rng(list(SILOS).index(silo) + 1)
    weights = rng.dirichlet(np.full(CLASSES, 0.5))
    y = rng.choice(CLASSES, size=40, p=weights).astype(np.int64)
    x = rng.random((len(y), *PLAN.model.image_shape), dtype=np.float32)
    return LabeledData(x, y, PLAN.model.classes)


HELD_OUT = {silo: held_out(silo) for silo in SILOS}


class Stub:
    """The aggregator's end of the RPCs `step_and_report` and `report_evaluation` make, recording them."""

    def __init__(self) -> None:
        self.headers: list = []
        self.evaluations: list = []
        self.signatures: list = []

    def ReportState(self, parts, timeout):  # noqa: N802 (the gRPC method's name)
        self.headers.append(next(iter(parts)).header)

    def Consistency(self, request, timeout):  # noqa: N802
        self.signatures.append(request)

    def signed(self) -> ConsistencySignature:
        """The consistency signature sent, as the aggregator's half receives it."""
        (request,) = self.signatures
        return ConsistencySignature(request.signature)

    def ReportEvaluation(self, request, timeout):  # noqa: N802
        self.evaluations.append(request)

    def reported(self) -> np.ndarray:
        """The counts of the one evaluation reported, as one vector (correct, then total)."""
        (request,) = self.evaluations
        return np.array([*request.correct, *request.total], dtype=np.int64)


def round_spec(round_number: int, round_id: str, state: GlobalState, **changes) -> round_pb2.RoundSpec:
    fields = {"round": round_number, "round_id": round_id, "seed": SEED, "consortium_id": CONSORTIUM}
    fields.update(state_digest=state.digest(), config_sha256=PLAN.sha256())
    return round_pb2.RoundSpec(**{**fields, **changes})


def attested(
    round_number: int, digest: str, counted: tuple[str, ...] = SILOS, signers: tuple[str, ...] | None = None
) -> Attested:
    """The signatures of `signers` (every counted silo by default) over the state `digest` of a round."""
    bound = {"consortium": CONSORTIUM, "round_number": round_number, "digest": digest, "counted": counted}
    return Attested(
        counted,
        {s: Attestation(attest(signer(s), **bound)) for s in (counted if signers is None else signers)},
    )


def later_spec(round_id: str, state: GlobalState, **changes) -> round_pb2.RoundSpec:
    """The RoundSpec of the round after `state`'s, carrying every counted silo's signature over it."""
    signed = attested(state.round, state.digest()).to_pb()
    return round_spec(state.round + 1, round_id, state, **{"attestations": signed, **changes})


CHECKS = {"peers": PEERS, "min_counted": 3}  # what the agent passes: the roster's peers, policy.min_survivors


def summed(state: GlobalState, nudge: float) -> torch.Tensor:
    """A contribution sum from one sample (n = 1) that moves every weight by `nudge` times a fixed pattern."""
    size = METHOD.schema(state).size
    total = nudge * torch.sin(torch.arange(size, dtype=torch.float64))
    total[-1] = 1.0
    return total


def following(state: GlobalState, nudge: float = 0.0) -> GlobalState:
    """The state FedAvg steps to from `summed(state, nudge)` (with no nudge, the same model a round on)."""
    schema = METHOD.schema(state)
    return METHOD.server_step(state, SumLayer.seal(schema, summed(state, nudge), 1), ServerContext(0, SEED))


def stepped(
    me: str, silos: tuple[str, ...], round_id: str, state: GlobalState, nudge: float = 0.0
) -> tuple[object, EncryptedUpload]:
    """`me` stepping the model after a contribution sum over `silos`: the half of the evaluation sum it waits
    on, and the evaluation upload it reported with its sealed state."""
    schema = METHOD.schema(state)
    sums = SimpleNamespace(
        half=SimpleNamespace(counted=silos, readers=silos),
        sums=SimpleNamespace(schema=schema, settings=None),
        result=summed(state, nudge),
    )
    taking_part = SimpleNamespace(spec=round_spec(state.round + 1, round_id, state), me=me, sums=sums)
    stub = Stub()
    half, digest = step_and_report(
        SiloTransport(stub, timeout=5.0),
        taking_part,
        side=SIDES[me],
        sign=SIDES[me].sign,
        secret=SECRET,
        state=state,
        method=METHOD,
        held_out=HELD_OUT[me],
        gate=ReleaseGate(consortium="c", floors=Floors(2, 2), members=lambda: SIDES, ledger=MemoryLedger()),
    )
    assert digest == following(state, nudge).digest()
    (header,) = stub.headers
    return half, upload_of(header.evaluation_kind, header.evaluation, layer="ckks")


def counts(silo: str, state: GlobalState = START, nudge: float = 0.0) -> np.ndarray:
    """`silo`'s true evaluation counts of the model stepped from `state`: correct, then total, per class."""
    return evaluation_counts(METHOD, following(state, nudge), HELD_OUT[silo]).numpy().astype(np.int64)


def difference(minuend: bytes, subtrahend: bytes) -> bytes:
    """What the aggregator can compute with its public context besides sums: one ciphertext minus another."""
    public = ts.context_from(SECRET.public.serialized)
    left, right = Ciphertext.parse(public, minuend), Ciphertext.parse(public, subtrahend)
    for mine, theirs in zip(left.chunks, right.chunks, strict=True):
        mine.sub_(theirs)
    return left.serialize()


def evaluation_half(me: str, silos: tuple[str, ...], round_id: str):
    spec = SumSpec(round_id, "evaluation", silos, evaluation_schema(CLASSES))
    return SIDES[me].half(spec, me, may_release=lambda survivors: None)


def signed(half, step: EncryptedSum) -> ConsistencySignature:
    """What `half`'s silo signs when handed `step`: `report_evaluation` sends it and reports nothing yet."""
    stub = Stub()
    assert not report_evaluation(SiloTransport(stub, timeout=5.0), 1, half, step)
    assert stub.evaluations == []
    return stub.signed()


def decrypted_report(half, blob: bytes, survivors: tuple[str, ...]) -> Stub:
    """What `half`'s silo reports when every silo of `survivors` is handed `blob` as the evaluation sum: a
    substitution the aggregator makes for all of them alike, which the consistency step lets through."""
    step = EncryptedSum(blob, survivors)
    signatures = {half.me: Signed(signed(half, step).signature)}
    for silo in set(survivors) - {half.me}:
        other = SIDES[silo].half(half.spec, silo, may_release=lambda _: None)
        signatures[silo] = Signed(signed(other, step).signature)
    stub = Stub()
    assert report_evaluation(SiloTransport(stub, timeout=5.0), 1, half, SumSignatures(signatures))
    return stub


@pytest.fixture(scope="module")
def evaluation_round():
    """Round 1 over SILOS as every silo steps it: each one's evaluation half and its masked upload."""
    return {me: stepped(me, SILOS, "r1.a1.release", START) for me in SILOS}


# --- the masks ----------------------------------------------------------------------------------------------

silo_sets = st.lists(st.text("abcdefgh-", min_size=1, max_size=6), min_size=2, max_size=6, unique=True)


@given(silo_sets, st.integers(3, 64))
@settings(max_examples=25, deadline=None)
def test_the_masks_of_a_set_add_to_exactly_zero_and_those_of_no_proper_subset_do(silos, size):
    masks = {me: zero_sum_mask(SECRET, "r1/evaluation", me, silos, size) for me in silos}
    assert np.array_equal(sum(masks.values()), np.zeros(size))
    for mask in masks.values():
        assert mask.dtype == np.float64
        assert np.array_equal(mask, np.rint(mask))
        assert np.abs(mask).max() <= (len(silos) - 1) * MASK_RANGE
    for k in range(1, len(silos)):
        for subset in itertools.combinations(silos, k):
            assert np.any(sum(masks[me] for me in subset) != 0), subset
    # every silo holds the same key, however it was given it, and lists the set in any order
    copy = SecretContext.from_secret_bytes(SECRET.secret_bytes())
    me = silos[0]
    assert np.array_equal(zero_sum_mask(copy, "r1/evaluation", me, silos[::-1], size), masks[me])


def test_a_mask_depends_on_the_sum_the_set_and_the_key():
    silos, me = ("a", "b", "c"), "a"
    mask = zero_sum_mask(SECRET, "r1/evaluation", me, silos, 32)
    others = {
        "another sum": zero_sum_mask(SECRET, "r2/evaluation", me, silos, 32),
        "a larger set": zero_sum_mask(SECRET, "r1/evaluation", me, (*silos, "d"), 32),
        "a smaller set": zero_sum_mask(SECRET, "r1/evaluation", me, silos[:2], 32),
        "another key": zero_sum_mask(SecretContext.new(), "r1/evaluation", me, silos, 32),
    }
    for what, other in others.items():
        assert np.count_nonzero(other != mask) > 16, what


# --- the evaluation sum: what a silo reports of a ciphertext the aggregator chose ---------------------------


def test_one_silos_unmasked_evaluation_upload_handed_over_as_the_sum_would_be_reported_exactly():
    """The attack, against silos that released their counts unmasked: `report_evaluation` reports VICTIM's
    per-class counts, which the aggregator was never meant to see apart from the others'."""
    spec = SumSpec("r1.a1.release", "evaluation", SILOS, evaluation_schema(CLASSES))
    uploads = {
        me: SIDES[me]
        .half(spec, me, may_release=lambda s: None)
        .start(torch.from_numpy(counts(me).astype(float)))
        for me in SILOS
    }
    (victims,) = uploads[VICTIM]
    stub = decrypted_report(evaluation_half(READER, SILOS, spec.round_id), victims.blob, SILOS)
    assert np.array_equal(stub.reported(), counts(VICTIM))


def test_one_silos_masked_evaluation_upload_handed_over_as_the_sum_is_refused(evaluation_round):
    _, victims = evaluation_round[VICTIM]
    for claimed in (SILOS, (VICTIM,)):  # READER signs no sum that leaves it out
        half = evaluation_half(READER, SILOS, "r1.a1.release")
        with pytest.raises(SumAborted, match=r"no counts|does not count"):
            decrypted_report(half, victims.blob, claimed)


def test_the_sum_of_any_proper_subset_is_refused_and_only_the_true_sum_is_reported(evaluation_round):
    uploads = {me: upload.blob for me, (_, upload) in evaluation_round.items()}
    for k in range(2, len(SILOS)):
        for subset in itertools.combinations(SILOS, k):
            partial = SECRET.public.add([uploads[me] for me in subset])
            for claimed in (SILOS, subset):
                with pytest.raises(SumAborted, match=r"no counts|does not count"):
                    decrypted_report(evaluation_half(READER, SILOS, "r1.a1.release"), partial, claimed)
    # the aggregator's own half, as it runs the sum: every silo reports the exact summed counts
    aggregator = AGGREGATOR.half(SumSpec("r1.a1.release", "evaluation", SILOS, evaluation_schema(CLASSES)))
    for me, (_, upload) in evaluation_round.items():
        aggregator.receive(me, upload)
    steps = aggregator.close()
    for me, (half, _) in evaluation_round.items():
        aggregator.receive(me, signed(half, steps[me]))
    steps = aggregator.close()
    truth = sum(counts(me) for me in SILOS)
    assert np.array_equal(
        truth[CLASSES:], sum(np.bincount(h.y, minlength=CLASSES) for h in HELD_OUT.values())
    )
    for me, (half, _) in evaluation_round.items():
        stub = Stub()
        assert report_evaluation(SiloTransport(stub, timeout=5.0), 1, half, steps[me])
        assert np.array_equal(stub.reported(), truth)


def test_masks_of_sums_over_other_sets_under_a_reused_round_id_do_not_cancel():
    """The aggregator signs every RoundSpec, round_id included, and silos do not check that it is new. Each
    round starts from a new state, so the release ledger lets each pick its own survivors. A silo's mask is
    ±p(x, o) for each other silo o of the set, with p the same in every sum that shares the id: one upload
    from each round, each round missing another silo, pairs every +p with its −p."""
    reused, state, uploads, halves = "r1.a1.reused", START, {}, {}
    plan = [("a", ("a", "b", "c")), ("b", ("a", "b", "d")), ("c", ("a", "c", "d")), ("d", ("b", "c", "d"))]
    for _, silos in plan:
        for me in silos:  # every silo of the round steps from its state and reports its masked counts
            halves[me, silos], upload = stepped(me, silos, reused, state)
            uploads[me, silos] = upload.blob
        state = following(state)
    last = plan[-1][1]
    honest = decrypted_report(halves["b", last], SECRET.public.add([uploads[me, last] for me in last]), last)
    crafted = SECRET.public.add([uploads[taken, silos] for taken, silos in plan])
    try:
        reported = decrypted_report(halves[READER, last], crafted, last).reported()
    except SumAborted:
        return  # refused: the masks did not cancel
    leaked = (reported - honest.reported())[CLASSES:]
    truth = np.bincount(HELD_OUT[VICTIM].y, minlength=CLASSES)
    assert not np.array_equal(leaked, truth), f"{VICTIM}'s held-out class totals leak: {leaked}"


def test_masks_of_two_rounds_over_the_same_set_under_a_reused_round_id_differ():
    """The ledger lets each round (a new starting state) pick survivors, the same ones too; the models of the
    two rounds differ, so do a silo's counts, and only the masks stand between them and the aggregator."""
    reused, silos, nudges = "r1.a1.reused", ("a", "b", "c"), (0.0, 3.0)
    states = (START, following(START, nudges[0]))
    rounds = [
        {me: stepped(me, silos, reused, s, n) for me in silos} for s, n in zip(states, nudges, strict=True)
    ]
    second = SECRET.public.add([upload.blob for _, upload in rounds[1].values()])
    honest = decrypted_report(rounds[1]["b"][0], second, silos)
    crafted = difference(SECRET.public.add([rounds[0][VICTIM][1].blob, second]), rounds[1][VICTIM][1].blob)
    change = counts(VICTIM, states[0], nudges[0]) - counts(VICTIM, states[1], nudges[1])
    if not change.any():
        pytest.fail("the two rounds' models score the same on the victim's data: nothing to leak")
    try:
        reported = decrypted_report(rounds[1][READER][0], crafted, silos).reported()
    except SumAborted:
        return  # refused: the masks did not cancel
    leaked = reported - honest.reported()
    assert not np.array_equal(leaked, change), f"{VICTIM}'s change in correct counts leaks: {leaked}"


# --- the sealed state: the aggregator keeps it, cannot read, alter or misplace it ---------------------------

PACKED = pack_state(following(START))
DIGEST = following(START).digest()
BOUND = {"consortium": CONSORTIUM, "round_number": 1, "digest": DIGEST}


def state_key(secret: SecretContext) -> bytes:
    """The sealing key written out: HKDF-SHA256 of the secret context, named by the key's id."""
    info = STATE_INFO + secret.context_id.encode()
    return HKDF(hashes.SHA256(), length=32, salt=None, info=info).derive(secret.secret_bytes())


def unauthenticated(secret: SecretContext, sealed: bytes) -> bytes:
    """What a sealed state decrypts to under ChaCha20 alone, its Poly1305 tag and bound names unchecked."""
    nonce, body = sealed[:NONCE], sealed[NONCE:-16]
    counter = (1).to_bytes(4, "little")  # RFC 8439: block 0 keys Poly1305, the text starts at block 1
    return Cipher(algorithms.ChaCha20(state_key(secret), counter + nonce), mode=None).decryptor().update(body)


def test_a_sealed_state_opens_with_the_key_every_silo_holds_and_each_seal_is_fresh():
    sealed = seal_state(SECRET, **BOUND, packed=PACKED)
    copy = SecretContext.from_secret_bytes(SECRET.secret_bytes())  # another silo's copy of the key
    assert open_state(copy, **BOUND, sealed=sealed) == PACKED
    assert unauthenticated(SECRET, sealed) == PACKED  # the key schedule as written out above
    again = seal_state(SECRET, **BOUND, packed=PACKED)
    assert again[:NONCE] != sealed[:NONCE]
    assert again != sealed
    assert PACKED not in sealed
    assert issubclass(SealedStateError, FedltError)  # the silo's round loop refuses the round, no crash


@pytest.mark.parametrize("index", [0, NONCE, NONCE + 1000, -17, -1])
def test_a_state_with_any_byte_flipped_is_refused(index):
    """The attack, had the state been sealed with ChaCha20 alone: a flipped ciphertext bit flips the same
    bit of the state (a weight of the aggregator's choosing); the tag refuses it, nonce and tag included."""
    sealed = bytearray(seal_state(SECRET, **BOUND, packed=PACKED))
    index %= len(sealed)
    sealed[index] ^= 0x40
    if NONCE <= index < len(sealed) - 16:
        altered = bytearray(PACKED)
        altered[index - NONCE] ^= 0x40
        assert unauthenticated(SECRET, bytes(sealed)) == altered
    with pytest.raises(SealedStateError, match="does not open"):
        open_state(SECRET, **BOUND, sealed=bytes(sealed))


@pytest.mark.parametrize(
    "moved",
    [
        {"round_number": 2},
        {"digest": START.digest()},
        {"consortium": "another-consortium"},
    ],
    ids=["as-another-round", "for-another-digest", "in-another-consortium"],
)
def test_a_sealed_state_replayed_elsewhere_is_refused(moved):
    """The attack: a genuine sealed state, which without bound names would open anywhere, handed over as
    another round's, another digest's or another consortium's (same key)."""
    sealed = seal_state(SECRET, **BOUND, packed=PACKED)
    assert unauthenticated(SECRET, sealed) == PACKED
    with pytest.raises(SealedStateError, match="does not open"):
        open_state(SECRET, **{**BOUND, **moved}, sealed=sealed)


def test_a_state_sealed_or_opened_under_another_key_is_refused():
    other = SecretContext.new()
    with pytest.raises(SealedStateError, match="does not open"):
        open_state(other, **BOUND, sealed=seal_state(SECRET, **BOUND, packed=PACKED))
    with pytest.raises(SealedStateError, match="does not open"):
        open_state(SECRET, **BOUND, sealed=seal_state(other, **BOUND, packed=PACKED))
    for short in (b"", b"x" * NONCE, b"x" * (NONCE + 15)):
        with pytest.raises(SealedStateError):
            open_state(SECRET, **BOUND, sealed=short)


# --- the starting state a silo steps from -------------------------------------------------------------------


def test_the_first_state_is_taken_only_if_it_is_the_seeded_initial_state():
    """The aggregator signs the RoundSpec, digest included, so a made-up first state would match the digest
    it signs; only the seed check (a state the silo recomputes) stops it."""
    spec = round_spec(1, "r1.a1.first", START)
    assert opened_state(pack_state(START), spec, SECRET, METHOD, **CHECKS).digest() == START.digest()
    made_up = METHOD.init_state(seed=SEED + 1)
    tampered = dict(START.model)
    name = next(k for k, v in tampered.items() if v.is_floating_point())
    tampered[name] = tampered[name] + 1e-3
    for state in (made_up, GlobalState(0, tampered, START.extra)):
        forged = round_spec(1, "r1.a1.first", START, state_digest=state.digest())
        assert unpack_state(pack_state(state), 0).digest() == forged.state_digest  # the attack without it
        with pytest.raises(StateRefused, match="not the method's initial state"):
            opened_state(pack_state(state), forged, SECRET, METHOD, **CHECKS)
    assert issubclass(StateRefused, SumAborted)


def test_a_later_state_is_opened_from_its_seal_and_nothing_else_is_taken():
    spec = later_spec("r2.a1.later", following(START))
    sealed = seal_state(SECRET, consortium=CONSORTIUM, round_number=1, digest=DIGEST, packed=PACKED)
    assert opened_state(sealed, spec, SECRET, METHOD, **CHECKS).digest() == DIGEST
    refused = {
        "the state unsealed": PACKED,
        "sealed as another round's": seal_state(
            SECRET, consortium=CONSORTIUM, round_number=2, digest=DIGEST, packed=PACKED
        ),
        "sealed under another key": seal_state(
            SecretContext.new(), consortium=CONSORTIUM, round_number=1, digest=DIGEST, packed=PACKED
        ),
    }
    for data in refused.values():
        with pytest.raises(SealedStateError):
            opened_state(data, spec, SECRET, METHOD, **CHECKS)
    # a key-holding silo can seal any state under the digest it names: opened_state does not recompute the
    # digest, the agent's check against the signed digest (silo/admission.py `starting_state`) does
    made_up = pack_state(METHOD.init_state(seed=SEED + 1))
    other = seal_state(SECRET, consortium=CONSORTIUM, round_number=1, digest=DIGEST, packed=made_up)
    assert opened_state(other, spec, SECRET, METHOD, **CHECKS).digest() != spec.state_digest


# --- the relay: it keeps the key holder's envelopes and nobody else's ---------------------------------------


def envelope(recipient: str, context_id: str, sender: str = HOLDER) -> SealedContext:
    """An envelope as the relay sees it: names and opaque bytes (the relay opens nothing)."""
    return SealedContext(sender, recipient, context_id, b"e" * 32, b"sealed key", b"signature")


KEY = SecretContext.new()
CKKS_KEYS = record("ckks").key_service


def relay_of(holder: str) -> KeyServiceRelay:
    """The aggregator's relay of a ckks consortium whose key holder is `holder`."""
    return KeyServiceRelay("ckks", CKKS_KEYS, holder)


def shared(
    relay: KeyServiceRelay, sender: str = HOLDER, context_id: str = KEY.context_id, recipients=(ME,)
) -> None:
    sealed = [envelope(r, context_id, sender) for r in recipients]
    relay.share(sender, b"certificate of " + sender.encode(), context_id, KEY.public.serialized, sealed)


def test_the_relay_hands_each_silo_the_holders_envelope_which_opens_to_the_key(run):
    relay = relay_of(HOLDER)
    assert not any(relay.eligible(s) for s in (HOLDER, ME, OTHER))
    with pytest.raises(NoKeyYet):
        relay.fetch(ME, run.secret.context_id)
    certificate = pem(run.root, HOLDER)
    relay.share(HOLDER, certificate, run.secret.context_id, run.secret.public.serialized, [run.sealed[ME]])
    assert relay.eligible(HOLDER)
    assert relay.eligible(ME)
    assert not relay.eligible(OTHER)  # no envelope for it yet
    with pytest.raises(NoKeyYet):
        relay.fetch(OTHER, run.secret.context_id)
    envelope_, holder_certificate = relay.fetch(ME, run.secret.context_id)
    assert run.open(envelope_, holder_certificate=holder_certificate).context_id == run.secret.context_id
    assert relay.public.serialized == run.secret.public.serialized


def test_a_silo_other_than_the_key_holder_cannot_share_a_key():
    """The attack, at a relay that took a share from anyone: another silo's "rotation" drops every envelope of
    the holder's key, so no silo can take a ckks round; the real relay refuses it and keeps the holder's."""
    unchecked = relay_of(OTHER)  # the check passes for OTHER here: what any sender would do without it
    shared(unchecked, sender=OTHER, recipients=(ME,))
    usurper = SecretContext.new()
    shared(unchecked, sender=OTHER, context_id=usurper.context_id, recipients=())
    with pytest.raises(NoKeyYet):
        unchecked.fetch(ME, KEY.context_id)
    assert not unchecked.eligible(ME)

    relay = relay_of(HOLDER)
    shared(relay)
    for context_id in (KEY.context_id, usurper.context_id):
        with pytest.raises(BadMessage, match="not the consortium's ckks key holder"):
            shared(relay, sender=OTHER, context_id=context_id, recipients=(ME,))
    assert relay.fetch(ME, KEY.context_id)[0].sender == HOLDER
    assert relay.context_id == KEY.context_id
    assert relay.eligible(ME)


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [
        (lambda: envelope(OTHER, KEY.context_id, sender=ME), "not of this key or this sender"),
        (lambda: envelope(OTHER, SecretContext.new().context_id), "not of this key or this sender"),
    ],
    ids=["another-sender", "another-key"],
)
def test_envelopes_of_another_sender_or_key_are_refused_and_nothing_is_kept(bad, refusal):
    relay = relay_of(HOLDER)
    shared(relay)
    with pytest.raises(BadMessage, match=refusal):
        relay.share(
            HOLDER, b"cert", KEY.context_id, KEY.public.serialized, [envelope(ME, KEY.context_id), bad()]
        )
    with pytest.raises(NoKeyYet):
        relay.fetch(OTHER, KEY.context_id)
    assert not relay.eligible(OTHER)
    with pytest.raises(BadMessage, match="names its context id"):
        relay.share(HOLDER, b"cert", "", KEY.public.serialized, [])
    with pytest.raises(BadMessage, match="the public part of the ckks key"):
        relay.share(HOLDER, b"cert", KEY.context_id, b"not a context", [])
    with pytest.raises(BadMessage, match="the public part of the ckks key"):
        relay.share(HOLDER, b"cert", KEY.context_id, KEY.secret_bytes(), [])  # never the secret key
    assert relay.fetch(ME, KEY.context_id)[0] == envelope(ME, KEY.context_id)


def test_a_rotation_replaces_every_envelope_of_the_old_key():
    relay = relay_of(HOLDER)
    shared(relay, recipients=(ME, OTHER))
    assert relay.eligible(OTHER)
    rotated = SecretContext.new()
    shared(relay, context_id=rotated.context_id, recipients=(ME,))
    assert relay.fetch(ME, rotated.context_id)[0].context_id == rotated.context_id
    for silo in (ME, OTHER):
        with pytest.raises(NoKeyYet, match="no ckks key"):
            relay.fetch(silo, KEY.context_id)  # the old key's envelope is gone
    with pytest.raises(NoKeyYet):
        relay.fetch(OTHER, rotated.context_id)  # nothing sealed to it under the new key yet
    assert not relay.eligible(OTHER)
    assert relay.eligible(ME)
    assert relay.eligible(HOLDER)
    shared(relay, context_id=rotated.context_id, recipients=(OTHER,))  # the same key, one more envelope
    assert relay.eligible(OTHER)
    assert relay.eligible(ME)


# --- the state the aggregator holds -------------------------------------------------------------------------


def test_a_plain_held_state_survives_the_store():
    held = HeldState.plain(START, METHOD)
    again = HeldState.from_stored(held.stored(), START.round, START.digest(), METHOD)
    assert (again.round, again.digest, again.blob) == (held.round, held.digest, held.blob)
    assert (again.schema, again.remaining, again.trains) == (held.schema, held.remaining, held.trains)
    assert again.model.digest() == START.digest()
    with pytest.raises(ValueError, match="does not match its digest"):
        HeldState.from_stored(held.stored(), START.round, DIGEST, METHOD)


def test_a_sealed_held_state_survives_the_store_without_a_model():
    sealed = seal_state(SECRET, **BOUND, packed=PACKED)
    state = following(START)
    held = HeldState.sealed(1, DIGEST, sealed, METHOD.schema(state), 3, False, attested(1, DIGEST))
    stored = held.stored()
    assert PACKED not in stored
    again = HeldState.from_stored(stored, 1, DIGEST, METHOD)
    assert again == held
    assert again.attested == held.attested  # a restarted aggregator still hands out every signature
    assert again.model is None
    assert open_state(SECRET, **BOUND, sealed=again.blob) == PACKED
    with pytest.raises(ValueError, match="does not match its digest"):
        HeldState.from_stored(stored, 1, START.digest(), METHOD)
    assert replace(again, remaining=2) != held


def test_after_a_key_rotation_the_state_sealed_under_the_old_key_still_opens_at_silos_holding_it(tmp_path):
    """The round after a rotation names the new key, but its starting state was sealed under the old one:
    a silo that holds both (its keyring keeps old keys) opens it; one given only the new key cannot."""
    spec = later_spec("r2.a1.rotated", following(START))
    keyring = Keyring(tmp_path, "ckks", CKKS_KEYS)
    old = keyring.rotate()
    sealed = seal_state(old, consortium=CONSORTIUM, round_number=1, digest=DIGEST, packed=PACKED)
    new = keyring.rotate()
    with pytest.raises(SealedStateError):
        opened_state(sealed, spec, new, METHOD, **CHECKS)
    assert opened_state(sealed, spec, new, METHOD, older=keyring.held(), **CHECKS).digest() == DIGEST
    assert {key.context_id for key in keyring.held()} == {old.context_id, new.context_id}
    assert keyring.current().context_id == new.context_id
