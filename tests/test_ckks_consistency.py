"""CKKS held to secagg's standard, probed as a hostile aggregator would probe it (issue 30, item 3).

The aggregator's public context adds a plaintext of its choosing to any ciphertext, and it chooses what each
silo decrypts, steps from and evaluates. Three checks stand in its way, each with the attack it stops:

- the consistency step (`privacy.ckks.halves`): a silo decrypts only a ciphertext every silo of the sum
  signed; handing the victim the true sum (or the sum plus its own P) and the others `E + P` is refused;
- evaluation masks bound to the state each silo stepped to (`silo.stepping`): they cancel only among silos
  that computed the same state, so counts of silos forced to other models never isolate one silo's;
- signed state digests (`privacy.stepping.attestation`): a silo steps from a sealed state only if every silo
  its sum counted signed that digest for that round, each a roster member, at least the silo's floor of them.

Each attack is first mounted where the check is absent (silos decrypting what they are handed, masks keyed by
the round's starting state as they were, a state taken on its seal), and shown to work; then the real halves,
`silo.stepping` and the aggregator's pieces refuse it. What one ciphertext handed to every silo alike still
does is shown too: an attack on the model's integrity, which reads no silo apart from the others.
"""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.config import ConsortiumConfig, ConsortiumSection
from aggregator.held_state import HeldState, StateReport
from aggregator.round_table import BadContribution
from aggregator.rounds import RoundDriver
from aggregator.store import Store
from attacks.ckks_sums import plus as add_plain
from fedlt.aggregation import Field, Schema, SumLayer
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate
from fedlt.aggregation.halves import PartyKeys, Released, SumAborted, SumSpec, evaluation_schema
from fedlt.methods import ServerContext
from fedlt.methods.state import GlobalState, pack_state
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.ckks.halves import (
    CONSISTENCY_CONTEXT,
    CkksAggregatorHalf,
    EncryptedSum,
    SumNotAgreed,
    SumSignatures,
    consistency_message,
    on_grid,
)
from privacy.ckks.layer import CkksSum
from privacy.ckks.wire import signatures_from_pb, signatures_to_pb
from privacy.crypto import transcript
from privacy.peers import ConsistencySignature, ConsortiumPeers, Signed
from privacy.pki.ca import issue_silo
from privacy.pki.signing import sign
from privacy.stepping.attestation import (
    Attestation,
    Attested,
    NotAttested,
    attest,
    check_attested,
    check_report,
)
from privacy.stepping.masks import zero_sum_mask
from privacy.stepping.sealed_state import open_state, seal_state
from privacy.wire import upload_of
from silo.stepping import evaluation_counts, one_thread, opened_state, report_evaluation, step_and_report
from silo.transport import SiloTransport
from tests.consortium_harness import AUDIT_KEY, PLAN
from tests.test_ckks import PEERS, SECRET, signer
from tests.test_ckks_ceremony import CONSORTIUM
from tests.test_ckks_release import (
    AGGREGATOR,
    CHECKS,
    CLASSES,
    HELD_OUT,
    METHOD,
    SEED,
    SIDES,
    SILOS,
    START,
    VICTIM,
    Stub,
    attested,
    later_spec,
    round_spec,
    signed,
)
from tests.test_roster import SILOS as ROSTER_SILOS
from tests.test_roster import consortium as consortium  # the module-scoped fixture: CA, 4 silos, roster
from tests.test_roster import key, pem, trust

SCHEMA = METHOD.schema(START)
BIAS = SCHEMA.size - 1 - CLASSES  # where the classifier's bias starts in the contribution's `delta`
ROUND_ID = "r1.a1.split"


def contribution(silo: str) -> torch.Tensor:
    """A silo's FedAvg contribution: small weight changes, and its sample count."""
    values = np.random.default_rng(SILOS.index(silo)).uniform(-1e-3, 1e-3, SCHEMA.size)
    values[-1] = 10.0
    return torch.from_numpy(values)


def always(cls: int) -> np.ndarray:
    """The P that, added to the contribution sum, makes the stepped model predict class `cls` for every image:
    the class's bias pushed far above every other logit."""
    p = np.zeros(SCHEMA.size)
    p[BIAS + cls] = 1000.0
    return p


def plus(blob: bytes, values: np.ndarray) -> bytes:
    """What the aggregator computes with its public context alone: a ciphertext plus a plaintext."""
    return add_plain(SECRET.public, blob, values)


def contribution_sum(round_id: str = ROUND_ID):
    """Every silo's real half of the contribution sum, uploaded; the aggregator's, closed on the true sum."""
    spec = SumSpec(round_id, "contribution", SILOS, SCHEMA, b"the RoundSpec's hash")
    halves = {me: SIDES[me].half(spec, me, may_release=lambda _: None) for me in SILOS}
    aggregator = AGGREGATOR.half(spec)
    for me, half in halves.items():
        (upload,) = half.start(contribution(me))
        aggregator.receive(me, upload)
    aggregator.close()
    return halves, aggregator


def decrypted(blob: bytes) -> torch.Tensor:
    """What a silo that decrypts whatever it is handed (no consistency step) takes for the sum."""
    return on_grid(SumSpec(ROUND_ID, "contribution", SILOS, SCHEMA), SECRET.decrypt(blob, SCHEMA.size))


def stepped_state(total: torch.Tensor) -> GlobalState:
    with one_thread():
        return METHOD.server_step(START, SumLayer.seal(SCHEMA, total, len(SILOS)), ServerContext(1, SEED))


def split(aggregator: CkksAggregatorHalf, victim_class: int) -> dict[str, bytes]:
    """The attack's ciphertexts: the victim's model forced to `victim_class`, every other one's to class 0."""
    return {me: plus(aggregator.summed, always(victim_class if me == VICTIM else 0)) for me in SILOS}


# --- (a) the chosen-plaintext split -------------------------------------------------------------------------


def evaluation_as_it_was(handed: dict[str, bytes]) -> np.ndarray:
    """What the aggregator read before this fix: each silo decrypted what it was handed, stepped, and masked
    its counts with masks keyed by the round's starting state; the aggregator summed the uploads and one silo
    reported the sum's counts."""
    spec = round_spec(1, ROUND_ID, START)
    sum_id = transcript(
        spec.consortium_id, spec.state_digest, spec.config_sha256, str(spec.seed), str(spec.round), ROUND_ID
    ).hex()
    masked = []
    for me in SILOS:
        total = decrypted(handed[me])
        counts = evaluation_counts(METHOD, stepped_state(total), HELD_OUT[me]).numpy()
        mask = zero_sum_mask(SECRET, f"{sum_id}/evaluation", me, SILOS, len(counts))
        masked.append(SECRET.encrypt(counts + mask, scale_bits=30))
    return np.rint(SECRET.decrypt(SECRET.public.add(masked), 2 * CLASSES)).astype(np.int64)


def test_a_split_sum_reads_one_silos_held_out_labels_where_silos_decrypt_what_they_are_handed():
    """The attack, as it worked before: one attempt per class k forces the victim's model to always answer k
    and everyone else's to always answer 0; the evaluation sum's correct count of class k is then the
    victim's number of held-out images of class k, and over the classes its whole label histogram."""
    _, aggregator = contribution_sum()
    histogram = np.bincount(HELD_OUT[VICTIM].y, minlength=CLASSES)
    shown = [k for k in range(1, CLASSES) if histogram[k]][:2]
    for k in shown:
        reported = evaluation_as_it_was(split(aggregator, k))
        assert reported[k] == histogram[k] > 0
        assert reported[CLASSES + k] > histogram[k]  # the total of class k is every silo's: no cover


def test_the_split_is_refused_at_the_consistency_step_and_no_silo_decrypts():
    halves, aggregator = contribution_sum()
    handed = split(aggregator, 1)
    for me in SILOS:
        (signature,) = halves[me].step(EncryptedSum(handed[me], SILOS))
        aggregator.receive(me, signature)
    steps = aggregator.close()  # the aggregator relays every signature, as it must for anyone to decrypt
    for me in SILOS:
        with pytest.raises(SumNotAgreed, match="signed another sum"):
            halves[me].step(steps[me])
        assert halves[me].result is None
        assert not halves[me].done


def test_the_victim_given_the_true_sum_and_the_rest_a_forced_one_is_refused_too():
    """The issue's form of the attack: the victim steps honestly, every other silo from `E + P`."""
    halves, aggregator = contribution_sum()
    forced = plus(aggregator.summed, always(0))
    signatures = {}
    for me in SILOS:
        blob = aggregator.summed if me == VICTIM else forced
        (signature,) = halves[me].step(EncryptedSum(blob, SILOS))
        signatures[me] = Signed(signature.signature)
    for me in SILOS:
        with pytest.raises(SumNotAgreed):
            halves[me].step(SumSignatures(signatures))
        assert halves[me].result is None


def test_masks_bound_to_the_stepped_state_leave_a_split_evaluation_as_no_counts():
    """Even with the consistency step bypassed (each silo stepping from what it was handed), the masks of
    silos that stepped to different models do not cancel: the evaluation sum is no counts, and its own
    consistency step refuses it first, since every silo binds it to the state it computed."""
    _, aggregator = contribution_sum()
    handed = split(aggregator, 1)
    evaluations, uploads = {}, {}
    for me in SILOS:
        result = decrypted(handed[me])
        evaluations[me], uploads[me], _ = step_from(me, result)
    spec = SumSpec(ROUND_ID, "evaluation", SILOS, evaluation_schema(CLASSES))
    evaluation = AGGREGATOR.half(spec)
    for me in SILOS:
        evaluation.receive(me, uploads[me])
    steps = evaluation.close()
    for me in SILOS:
        evaluation.receive(me, signed(evaluations[me], steps[me]))
    steps = evaluation.close()
    with pytest.raises(SumNotAgreed):
        report_evaluation(SiloTransport(Stub(), timeout=5.0), 1, evaluations[VICTIM], steps[VICTIM])
    values = SECRET.decrypt(evaluation.summed, 2 * CLASSES)  # the check absent: what the masks leave
    counts = np.rint(values).astype(np.int64)
    correct, total = counts[:CLASSES], counts[CLASSES:]
    assert (correct < 0).any() or (correct > total).any() or np.abs(counts).max() > 1000


def step_from(me: str, result: torch.Tensor) -> tuple[object, object, pb.StateReportHeader]:
    """`me` stepping with the real `step_and_report` from a decrypted sum: its evaluation half and upload,
    and the header of its state report."""
    sums = SimpleNamespace(
        half=SimpleNamespace(counted=SILOS, readers=SILOS),
        sums=SimpleNamespace(schema=SCHEMA, settings=None),
        result=result,
    )
    taking_part = SimpleNamespace(spec=round_spec(1, ROUND_ID, START), me=me, sums=sums)
    stub = Stub()
    half, _ = step_and_report(
        SiloTransport(stub, timeout=5.0),
        taking_part,
        side=SIDES[me],
        sign=SIDES[me].sign,
        secret=SECRET,
        state=START,
        method=METHOD,
        held_out=HELD_OUT[me],
        gate=ReleaseGate(consortium="c", floors=Floors(2, 2), members=lambda: SIDES, ledger=MemoryLedger()),
    )
    (header,) = stub.headers
    return half, upload_of(header.evaluation_kind, header.evaluation, layer="ckks"), header


# --- (b) one ciphertext for all: an attack on the model, not a read of one silo -----------------------------


def test_the_same_forced_sum_for_every_silo_passes_and_reads_no_silo_apart_from_the_others():
    """The consistency step cannot tell `E + P` from `E` when every silo is handed it: all sign, all decrypt
    the same numbers and step to the same (forced) model. That is an attack on the model's integrity, as an
    aggregator's model is under secagg; what it releases is the evaluation sum over every silo of the set, in
    which no silo's counts stand apart: here the consortium's count of class 0, and every class's total."""
    halves, aggregator = contribution_sum()
    forced = plus(aggregator.summed, always(0))
    for me in SILOS:
        (signature,) = halves[me].step(EncryptedSum(forced, SILOS))
        aggregator.receive(me, signature)
    steps = aggregator.close()
    for me in SILOS:
        assert halves[me].step(steps[me]) == []
    results = [halves[me].result for me in SILOS]
    assert all(torch.equal(r, results[0]) for r in results)
    evaluations, uploads = {}, {}
    for me in SILOS:
        evaluations[me], uploads[me], _ = step_from(me, results[0])
    spec = SumSpec(ROUND_ID, "evaluation", SILOS, evaluation_schema(CLASSES))
    evaluation = AGGREGATOR.half(spec)
    for me in SILOS:
        evaluation.receive(me, uploads[me])
    steps = evaluation.close()
    for me in SILOS:
        evaluation.receive(me, signed(evaluations[me], steps[me]))
    steps = evaluation.close()
    stub = Stub()
    assert report_evaluation(SiloTransport(stub, timeout=5.0), 1, evaluations[VICTIM], steps[VICTIM])
    reported = stub.reported()
    totals = sum(np.bincount(HELD_OUT[me].y, minlength=CLASSES) for me in SILOS)
    assert np.array_equal(reported[CLASSES:], totals)
    assert reported[0] == totals[0]
    assert not reported[1:CLASSES].any()


# --- the consistency step itself ----------------------------------------------------------------------------

SMALL = Schema((Field("delta", (50,), 4.0, frac_bits=20), Field("n", (), 100.0, frac_bits=0)))


@given(st.sets(st.sampled_from(SILOS)), st.sampled_from(SILOS))
@settings(max_examples=12, deadline=None)
def test_no_silo_decrypts_unless_every_silo_was_handed_the_same_sum(altered, victim):
    """Whichever silos get `E + P` instead of `E`: all refuse if some do, all decrypt alike if none or all."""
    spec = SumSpec("r1.small", "contribution", SILOS, SMALL, b"binding")
    halves = {me: SIDES[me].half(spec, me, may_release=lambda _: None) for me in SILOS}
    aggregator = AGGREGATOR.half(spec)
    for me, half in halves.items():
        (upload,) = half.start(torch.full((SMALL.size,), 1.0, dtype=torch.float64))
        aggregator.receive(me, upload)
    aggregator.close()
    nudge = np.zeros(SMALL.size)
    nudge[SILOS.index(victim)] = 0.5
    for me in SILOS:
        blob = plus(aggregator.summed, nudge) if me in altered else aggregator.summed
        (signature,) = halves[me].step(EncryptedSum(blob, SILOS))
        aggregator.receive(me, signature)
    steps = aggregator.close()
    for me in SILOS:
        if altered and len(altered) < len(SILOS):
            with pytest.raises(SumNotAgreed):
                halves[me].step(steps[me])
        else:
            halves[me].step(steps[me])
    results = [halves[me].result for me in SILOS]
    if altered and len(altered) < len(SILOS):
        assert results == [None] * len(SILOS)
    else:
        assert all(torch.equal(r, results[0]) for r in results)


def signed_step(spec: SumSpec, blob: bytes, survivors: tuple[str, ...]) -> tuple[dict, dict]:
    halves = {me: SIDES[me].half(spec, me, may_release=lambda _: None) for me in survivors}
    signatures = {}
    for me, half in halves.items():
        (signature,) = half.step(EncryptedSum(blob, survivors))
        signatures[me] = Signed(signature.signature)
    return halves, signatures


def test_a_missing_forged_foreign_or_misdirected_signature_stops_every_silo():
    spec = SumSpec("r1.small", "contribution", SILOS, SMALL, b"binding")
    blob = SECRET.encrypt(np.zeros(SMALL.size), scale_bits=30)
    _, signatures = signed_step(spec, blob, SILOS)
    others = SumSpec("r2.small", "contribution", SILOS, SMALL, b"binding")
    _, elsewhere = signed_step(others, blob, SILOS)  # the same ciphertext signed for another round's sum
    _, fewer = signed_step(spec, blob, SILOS[:3])  # the same ciphertext, signed as counting three silos
    message = consistency_message(spec, hashlib.sha256(blob).digest(), SILOS)
    forged = Signed(signer("b")(message, context=CONSISTENCY_CONTEXT))  # b's key, in a's name
    cases = {
        "a signature withheld": {s: v for s, v in signatures.items() if s != "c"},
        "one of another round's sum": {**signatures, "c": elsewhere["c"]},
        "one over another survivor list": {**signatures, "b": fewer["b"]},
        "one made with another silo's key": {**signatures, "a": forged},
        "one from a silo the sum does not count": {**signatures, "z": signatures["a"]},
    }
    for what, given_signatures in cases.items():
        halves, _ = signed_step(spec, blob, SILOS)
        for me in SILOS:
            with pytest.raises(SumNotAgreed):
                halves[me].step(SumSignatures(given_signatures))
            with pytest.raises(SumAborted, match="no signed sum waits"):  # refused once, refused for good
                halves[me].step(SumSignatures(signatures))
            assert halves[me].result is None, what
    halves, _ = signed_step(spec, blob, SILOS)
    for me in SILOS:  # the genuine set: every silo decrypts
        halves[me].step(SumSignatures(signatures))
        assert halves[me].done
        assert halves[me].counted == SILOS


def test_the_aggregator_aborts_a_sum_a_survivor_did_not_sign_and_takes_no_stray_signature():
    spec = SumSpec("r1.small", "contribution", SILOS, SMALL, b"binding")
    halves = {me: SIDES[me].half(spec, me, may_release=lambda _: None) for me in SILOS[:3]}
    aggregator = AGGREGATOR.half(spec)
    for me, half in halves.items():
        (upload,) = half.start(torch.ones(SMALL.size, dtype=torch.float64))
        aggregator.receive(me, upload)
    steps = aggregator.close()
    assert aggregator.stage == "sign"
    assert set(aggregator.expected) == set(SILOS[:3])
    assert aggregator.download("a") == aggregator.summed
    for me in ("a", "b"):
        (signature,) = halves[me].step(steps[me])
        aggregator.receive(me, signature)
        aggregator.receive(me, signature)  # an identical resend
    with pytest.raises(SumAborted, match="another consistency signature"):
        aggregator.receive("a", ConsistencySignature(b"another"))
    with pytest.raises(SumAborted, match="not counted"):
        aggregator.receive("d", ConsistencySignature(b"d never uploaded"))
    assert aggregator.answered == {"a", "b"}
    with pytest.raises(SumAborted, match="c did not sign"):
        aggregator.close()


def test_signatures_travel_with_their_certificates_and_a_silo_listed_twice_is_refused():
    step = SumSignatures({"a": Signed(b"sa", b"pem a"), "b": Signed(b"sb", b"pem b")})
    message = pb.SumStep(round_id="r1", sum=pb.SECURE_SUM_CONTRIBUTION, **signatures_to_pb(step))
    again = pb.SumStep.FromString(message.SerializeToString())
    assert signatures_from_pb(again) == step
    again.ckks_signatures.signatures.append(pb.CkksSiloSignature(silo_id="a", signature=b"other"))
    with pytest.raises(SumAborted, match="listed twice"):
        signatures_from_pb(again)


def uploaded() -> tuple[dict[str, list], dict, CkksAggregatorHalf]:
    """A small sum every silo uploaded to, each silo's release checks recorded."""
    spec = SumSpec("r1.small", "contribution", SILOS, SMALL, b"binding")
    asked: dict[str, list] = {me: [] for me in SILOS}
    halves = {me: SIDES[me].half(spec, me, may_release=asked[me].append) for me in SILOS}
    aggregator = AGGREGATOR.half(spec)
    for me, half in halves.items():
        (upload,) = half.start(torch.ones(SMALL.size, dtype=torch.float64))
        aggregator.receive(me, upload)
    return asked, halves, aggregator


def test_a_silo_releases_at_decryption_so_a_sum_nobody_could_decrypt_pins_no_survivor_set():
    """Under ckks every silo holds the key, so a sum's inputs are read where a silo decrypts it: the release
    check (the gate, the ledger) comes after every signature checked and before decrypting. A survivor that
    never signs leaves every other silo with nothing pinned, and the aggregator with nothing settled, so the
    round can be retried without it."""
    asked, halves, aggregator = uploaded()
    steps = aggregator.close()
    assert aggregator.counted is None
    for me in SILOS[:3]:  # d never signs
        (signature,) = halves[me].step(steps[me])
        aggregator.receive(me, signature)
    assert aggregator.counted is None
    with pytest.raises(SumAborted, match="d did not sign"):
        aggregator.close()
    assert asked == {me: [] for me in SILOS}
    assert all(half.result is None for half in halves.values())

    asked, halves, aggregator = uploaded()
    steps = aggregator.close()
    for me in SILOS:
        (signature,) = halves[me].step(steps[me])
        aggregator.receive(me, signature)
    steps = aggregator.close()
    assert aggregator.counted == SILOS  # settled where the signatures go out: the aggregator pins it here
    for me in SILOS:
        halves[me].step(steps[me])
    assert asked == {me: [SILOS] for me in SILOS}


# --- (c) the state a silo steps from ------------------------------------------------------------------------

STATE = stepped_state(torch.from_numpy(np.append(np.full(SCHEMA.size - 1, 1e-4), 40.0)))
SEALED = seal_state(
    SECRET, consortium=CONSORTIUM, round_number=1, digest=STATE.digest(), packed=pack_state(STATE)
)


def test_a_state_sealed_by_one_silo_opens_on_its_seal_alone():
    """The attack without attestations: any silo holding the key seals any state, which the aggregator then
    commits as the round's; the seal opens for every silo, so the seal is no proof that others computed it."""
    bound = {"consortium": CONSORTIUM, "round_number": 1, "digest": STATE.digest()}
    assert open_state(SECRET, **bound, sealed=SEALED) == pack_state(STATE)


@pytest.mark.parametrize(
    ("attestations", "refusal"),
    [
        (lambda d: attested(1, d, signers=("a",)), "lacks the signatures of b, c, d"),
        (lambda d: attested(1, d, counted=("a",)), "fewer than this silo's floor of 3"),
        (lambda d: attested(1, d, counted=("a", "b")), "fewer than this silo's floor of 3"),
        (lambda d: attested(1, START.digest()), "did not sign state"),
        (lambda d: attested(2, d), "did not sign state"),
        (
            lambda d: Attested(SILOS, {**attested(1, d).by_silo, "c": attested(1, d).by_silo["a"]}),
            "c did not",
        ),
        (lambda d: Attested(("d", "c", "b", "a"), attested(1, d).by_silo), "out of order"),
        (lambda d: Attested(SILOS, {}), "lacks the signatures"),
        (lambda d: None, "a sum of 0 silos"),
    ],
    ids=[
        "one-silo-alone",
        "a-sum-of-one",
        "a-sum-below-the-floor",
        "signed-for-another-digest",
        "signed-for-another-round",
        "one-signature-copied-for-another-silo",
        "counted-out-of-order",
        "no-signatures",
        "no-attestations-at-all",
    ],
)
def test_a_state_not_signed_by_every_counted_silo_is_refused(attestations, refusal):
    spec = round_spec(2, "r2.a1.state", STATE)
    given_attestations = attestations(STATE.digest())
    if given_attestations is not None:
        spec.attestations.CopyFrom(given_attestations.to_pb())
    with pytest.raises(NotAttested, match=refusal):
        opened_state(SEALED, spec, SECRET, METHOD, **CHECKS)


def test_a_state_every_counted_silo_signed_opens_and_a_higher_floor_refuses_it():
    spec = later_spec("r2.a1.state", STATE)
    assert opened_state(SEALED, spec, SECRET, METHOD, **CHECKS).digest() == STATE.digest()
    with pytest.raises(NotAttested, match="floor of 5"):
        opened_state(SEALED, spec, SECRET, METHOD, peers=PEERS, min_counted=5)


def test_only_roster_members_sign_a_state_and_the_aggregator_checks_each_report(consortium, tmp_path):
    """With certificates: a Sybil the CA issued but the roster does not name, or a member's key under another
    silo's name, signs nothing a silo counts; the aggregator refuses such a report and keeps none."""
    root, roster = consortium
    members, peers = trust(root, roster), ConsortiumPeers(trust(root, roster))
    issue_silo(root / "ca", tmp_path / "kits", silo_id="sybil-3")
    roots = {**dict.fromkeys(ROSTER_SILOS, root), "sybil-3": tmp_path}
    bound = {"consortium": CONSORTIUM, "round_number": 1, "digest": STATE.digest()}

    def attestation(silo: str, counted: tuple[str, ...], signed_by: str = "") -> Attestation:
        signing = key(roots[signed_by or silo], signed_by or silo)
        signature = attest(
            lambda data, *, context: sign(signing, data, context=context), **bound, counted=counted
        )
        return Attestation(signature, pem(roots[signed_by or silo], signed_by or silo))

    counted = tuple(sorted(ROSTER_SILOS))
    genuine = {silo: attestation(silo, counted) for silo in counted}
    check_attested(Attested(counted, genuine), **bound, peers=peers, min_counted=3)
    for silo, kept in genuine.items():
        check_report(members, silo, kept, **bound, counted=counted)

    first = counted[0]
    for bad in (
        attestation(first, counted, signed_by="sybil-3"),
        attestation(first, counted, signed_by=counted[1]),
    ):
        with pytest.raises(NotAttested, match=f"{first} did not sign"):
            check_attested(Attested(counted, {**genuine, first: bad}), **bound, peers=peers, min_counted=3)
        with pytest.raises(NotAttested):
            check_report(members, first, bad, **bound, counted=counted)
    with_sybil = tuple(sorted((*counted, "sybil-3")))  # a Sybil counted in the sum, all five signing it
    signatures = {silo: attestation(silo, with_sybil) for silo in with_sybil}
    with pytest.raises(NotAttested, match="sybil-3 did not sign"):
        check_attested(Attested(with_sybil, signatures), **bound, peers=peers, min_counted=3)
    with pytest.raises(NotAttested, match="sybil-3"):
        check_report(members, "sybil-3", signatures["sybil-3"], **bound, counted=with_sybil)


def report(silo: str, digest: str, round_number: int = 1, counted: tuple[str, ...] = SILOS) -> StateReport:
    bound = {"consortium": CONSORTIUM, "round_number": round_number, "digest": digest, "counted": counted}
    return StateReport(
        digest=digest,
        sealed=SEALED,
        schema=METHOD.schema(STATE),
        remaining=3,
        trains=True,
        evaluation=None,
        round=round_number,
        counted=counted,
        attestation=Attestation(attest(signer(silo), **bound)),
    )


def test_the_aggregator_keeps_every_counted_silos_signature_with_the_state_through_a_restart():
    reports = {silo: report(silo, STATE.digest()) for silo in SILOS}
    held = HeldState.reported(1, SILOS, SILOS, reports)
    assert held.attested.counted == SILOS
    again = HeldState.from_stored(held.stored(), 1, STATE.digest(), METHOD)
    assert again.attested == held.attested
    spec = round_spec(2, "r2.a1.kept", STATE, attestations=again.attested.to_pb())
    assert opened_state(SEALED, spec, SECRET, METHOD, **CHECKS).digest() == STATE.digest()
    twice = again.attested.to_pb()
    twice.signatures.append(round_pb2.StateSignature(silo_id="a", signature=b"again"))
    with pytest.raises(NotAttested, match="twice"):
        Attested.from_pb(twice)


def test_a_sealed_state_stored_without_signatures_is_refused_by_the_next_silos():
    """A store written before the state kept its signatures: the aggregator loads it, silos refuse it."""
    held = HeldState.sealed(1, STATE.digest(), SEALED, METHOD.schema(STATE), 3, True, None)
    again = HeldState.from_stored(held.stored(), 1, STATE.digest(), METHOD)
    assert again.attested is None
    with pytest.raises(NotAttested):
        opened_state(SEALED, round_spec(2, "r2.a1.bare", STATE), SECRET, METHOD, **CHECKS)


def test_a_state_read_by_fewer_silos_than_counted_needs_every_readers_signature_naming_them():
    """Under blind a silo lost after its masked input is counted (its input is in the sum) but reads nothing:
    the silos that read the sum sign the state naming themselves, and it is accepted; the aggregator cannot
    drop one of their signatures, as the others name that silo, nor pass them off as every counted silo's."""
    readers = ("a", "b", "c")
    bound = {"consortium": CONSORTIUM, "round_number": 1, "digest": STATE.digest()}
    signed = {s: Attestation(attest(signer(s), **bound, counted=SILOS, readers=readers)) for s in readers}
    check_attested(Attested(SILOS, signed), **bound, peers=PEERS, min_counted=2)
    dropped = Attested(SILOS, {s: signed[s] for s in ("a", "b")})
    with pytest.raises(NotAttested, match="lacks the signatures of c, d: a signed it as read by others"):
        check_attested(dropped, **bound, peers=PEERS, min_counted=2)
    with pytest.raises(NotAttested, match="did not sign state"):  # as if read by every counted silo
        check_attested(Attested(readers, signed), **bound, peers=PEERS, min_counted=2)


def test_each_silo_signs_the_state_it_stepped_to_in_its_report():
    """The report's signature is over the digest the silo computed, its round and the silos the sum counted;
    the evaluation sum it joins is bound to that digest too."""
    total = torch.from_numpy(np.append(np.full(SCHEMA.size - 1, 1e-4), 40.0))
    half, _, header = step_from("b", total)
    digest = stepped_state(total).digest()
    assert (header.state_digest, header.round, tuple(header.counted)) == (digest, 1, SILOS)
    bound = {"consortium": CONSORTIUM, "round_number": 1, "digest": digest}
    alone = Attested(("b",), {"b": Attestation(header.state_signature)})
    with pytest.raises(NotAttested):  # signed over the four counted silos, not over "b" alone
        check_attested(alone, **bound, peers=PEERS, min_counted=1)
    everyone = attested(1, digest)
    signed_by_b = Attested(SILOS, {**everyone.by_silo, "b": Attestation(header.state_signature)})
    check_attested(signed_by_b, **bound, peers=PEERS, min_counted=3)
    assert digest.encode().hex() in half.spec.binding.hex()


# --- the aggregator: it commits only a state every counted silo reported and signed -------------------------


@pytest.fixture
def driver(tmp_path):
    """A round driver under ckks (its keys: the public context), in a round whose sum counted every silo."""
    section = ConsortiumSection(id=CONSORTIUM, rounds=3, privacy="ckks")
    config = ConsortiumConfig(consortium=section, plan=PLAN)
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    for silo in SILOS:
        store.register_silo(silo, "certificate digest", "v", {})
    layer = CkksSum()
    driver = RoundDriver(
        config=config,
        store=store,
        method=METHOD,
        layer=layer,
        side=layer.aggregator_side(PartyKeys(secret=SECRET.public)),
        sign=lambda blob: b"signature",
        recorder=None,
        echo=lambda _: None,
    )
    attempt = driver._start_attempt(list(SILOS))
    attempt.contributors = attempt.readers = SILOS
    yield driver, attempt
    store.close()


def test_the_aggregator_refuses_a_report_signed_for_another_round_or_silo_set(driver):
    driver, attempt = driver
    digest = STATE.digest()
    with pytest.raises(BadContribution, match="round 2's"):
        driver.inbox.report_state("a", attempt.round_id, report("a", digest, round_number=2))
    with pytest.raises(BadContribution, match="from a sum of a, b, c"):
        driver.inbox.report_state("a", attempt.round_id, report("a", digest, counted=SILOS[:3]))
    assert attempt.reports == {}


def test_the_aggregator_commits_no_state_a_counted_silo_did_not_report(driver):
    """A state reported by some counted silos only (one gone, say) would be refused by every silo of the next
    round; it is not committed, and the round is tried again."""
    driver, attempt = driver
    for silo in SILOS[:3]:
        driver.inbox.report_state(silo, attempt.round_id, report(silo, STATE.digest()))
    released = Released(SILOS, None)
    with pytest.raises(SumAborted, match="d reported no next state"):
        driver.committer.next_state(attempt, released, threading.Event())
    driver.inbox.report_state("d", attempt.round_id, report("d", STATE.digest()))
    held = driver.committer.next_state(attempt, released, threading.Event())
    assert held.attested.counted == SILOS
    driver.table.held = held  # as `commit` keeps it: the next RoundSpec carries every signature
    following = driver._start_attempt(list(SILOS))
    spec = round_pb2.RoundSpec.FromString(following.signed.spec)
    assert Attested.from_pb(spec.attestations) == held.attested
    assert opened_state(SEALED, spec, SECRET, METHOD, **CHECKS).digest() == STATE.digest()
