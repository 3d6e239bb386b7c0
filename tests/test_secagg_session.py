"""The secure-aggregation protocol as an adversary would probe it: dropouts at every stage, tampering, replay,
split views, and what a single masked upload reveals (nothing measurable)."""

from __future__ import annotations

import secrets
from dataclasses import replace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema, make_layer
from privacy.pki.signing import sign
from privacy.secagg import tail_guard
from privacy.secagg.codec import FixedPointCodec
from privacy.secagg.layer import SecAggSum
from privacy.secagg.local import STAGES, run_session
from privacy.secagg.peers import KeyPeers
from privacy.secagg.protocol import (
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
    default_threshold,
)
from privacy.secagg.settings import SecAggSettings

WORDS = 32


def ids(n: int) -> tuple[str, ...]:
    return tuple(f"s{i:02d}" for i in range(n))


def random_inputs(spec: SessionSpec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {u: rng.integers(0, 2**64, spec.words, dtype=np.uint64) for u in spec.participants}


def total(vectors) -> np.ndarray:
    out = np.zeros(WORDS, dtype=np.uint64)
    for v in vectors:
        out += v
    return out


def survivors_by_stage(participants: tuple[str, ...], dropouts: dict[str, str]) -> list[set[str]]:
    """U1..U5: who answers each stage, given the first stage each dropped silo misses."""
    alive, sets = set(participants), []
    for stage in STAGES:
        alive -= {u for u, s in dropouts.items() if s == stage}
        sets.append(set(alive))
    return sets


@given(
    n=st.sampled_from([2, 3, 5, 10]),
    stages=st.lists(st.sampled_from([*STAGES, "never"]), min_size=10, max_size=10),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_any_dropout_set_gives_the_survivors_exact_sum_or_aborts(n, stages, seed):
    spec = SessionSpec("r1.a1", "contribution", ids(n), WORDS)
    dropouts = {u: s for u, s in zip(spec.participants, stages, strict=False) if s != "never"}
    inputs = random_inputs(spec, seed)
    expected_ok = all(len(alive) >= spec.t for alive in survivors_by_stage(spec.participants, dropouts))
    if not expected_ok:
        with pytest.raises(TooFewSurvivors):
            run_session(spec, inputs, dropouts=dropouts)
        return
    summed, u3 = run_session(spec, inputs, dropouts=dropouts)
    assert set(u3) == survivors_by_stage(spec.participants, dropouts)[2]
    assert np.array_equal(summed, total(inputs[u] for u in u3))


@given(stages=st.lists(st.sampled_from([*STAGES, "never", "never"]), min_size=12, max_size=12))
@settings(max_examples=15, deadline=None)
def test_secagg_plus_sums_exactly_or_aborts(stages):
    spec = SessionSpec("r1.a1", "contribution", ids(12), WORDS, neighbours=4)
    assert spec.t == 4  # more than two thirds of each seed's 5 holders
    assert all(len(spec.graph[u]) == 4 for u in spec.participants)
    assert all(u in spec.graph[v] for u in spec.participants for v in spec.graph[u])  # symmetric
    dropouts = {u: s for u, s in zip(spec.participants, stages, strict=True) if s != "never"}
    inputs = random_inputs(spec, 7)
    try:
        summed, u3 = run_session(spec, inputs, dropouts=dropouts)
    except TooFewSurvivors:
        return
    assert np.array_equal(summed, total(inputs[u] for u in u3))


def test_secagg_plus_without_dropouts_sums_everyone():
    spec = SessionSpec("r1.a1", "contribution", ids(12), WORDS, neighbours=4)
    inputs = random_inputs(spec, 3)
    summed, u3 = run_session(spec, inputs)
    assert u3 == spec.participants
    assert np.array_equal(summed, total(inputs.values()))


@given(
    rows=st.lists(st.lists(st.floats(-50, 50), min_size=5, max_size=5), min_size=2, max_size=6),
    frac_bits=st.integers(4, 30),
)
@settings(max_examples=25, deadline=None)
def test_float_sums_are_within_the_codec_bound(rows, frac_bits):
    schema = Schema((Field("x", (5,), 40.0, frac_bits=frac_bits),))
    codec = FixedPointCodec(schema, max_silos=len(rows))
    spec = SessionSpec("r1.a1", "contribution", ids(len(rows)), 5)
    vectors = [torch.tensor(r, dtype=torch.float64) for r in rows]
    summed, _ = run_session(
        spec, {u: codec.encode(v) for u, v in zip(spec.participants, vectors, strict=True)}
    )
    truth = torch.stack([v.clamp(-40, 40) for v in vectors]).sum(0)
    assert (codec.decode(summed) - truth).abs().max().item() <= len(rows) * 2.0**-frac_bits


def test_secagg_layer_matches_plaintext_within_the_codec_bound():
    schema = Schema((Field("delta", (50,), 10.0, frac_bits=20), Field("n", (), 100.0, frac_bits=0)))
    generator = torch.Generator().manual_seed(0)
    contributions = [
        schema.contribution(delta=torch.randn(50, generator=generator, dtype=torch.float64), n=float(k + 1))
        for k in range(4)
    ]
    secure, plain = make_layer("secagg"), make_layer("plaintext")
    a, b = secure.aggregate(schema, contributions), plain.aggregate(schema, contributions)
    assert a.contributors == b.contributors == 4
    assert (a["delta"] - b["delta"]).abs().max().item() <= 4 * 2.0**-20
    assert float(a["n"]) == float(b["n"]) == 10.0


# --- a hand-driven session, for tampering -------------------------------------------------------------


class Session:
    """Clients and server of one session, driven stage by stage so a test can interfere between stages."""

    def __init__(self, n: int = 3, *, round_id: str = "r1.a1", binding: bytes = b"state") -> None:
        self.spec = SessionSpec(round_id, "contribution", ids(n), WORDS, binding=binding)
        self.keys = {u: ec.generate_private_key(ec.SECP256R1()) for u in self.spec.participants}
        self.peers = KeyPeers({u: k.public_key() for u, k in self.keys.items()})
        self.clients = {u: self.client(u, self.spec) for u in self.spec.participants}
        self.server = SecAggServer(self.spec, peers=self.peers)
        self.inputs = random_inputs(self.spec, 0)

    def client(self, u: str, spec: SessionSpec) -> SecAggClient:
        key = self.keys[u]
        return SecAggClient(
            spec, u, sign=lambda d, *, context: sign(key, d, context=context), peers=self.peers
        )

    def advertise(self) -> list[AdvertisedKeys]:
        for u, c in self.clients.items():
            self.server.add_keys(u, c.advertise())
        return self.server.close_keys()

    def share(self, advertised: list[AdvertisedKeys]) -> dict[str, Inbox]:
        for u, c in self.clients.items():
            self.server.add_envelopes(u, c.share(advertised))
        return self.server.close_shares()

    def mask(self, inboxes: dict[str, Inbox], among=None) -> tuple[str, ...]:
        for u in among or self.clients:
            self.server.add_masked(u, self.clients[u].masked_input(inboxes[u], self.inputs[u]))
        return self.server.close_masked()

    def through_masking(self, among=None) -> tuple[str, ...]:
        return self.mask(self.share(self.advertise()), among)


def test_a_forged_key_signature_is_refused_by_peers_and_aggregator():
    session = Session()
    advertised = session.advertise()
    a, b = advertised[0], advertised[1]
    forged = replace(
        b, signature=sign(session.keys[a.silo], session.spec.key_message(b), context="fedlt/secagg/keys/v1")
    )
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        session.clients[a.silo].share([a, forged, *advertised[2:]])
    fresh = Session()
    keys = fresh.clients["s00"].advertise()
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        fresh.server.add_keys("s00", replace(keys, c_public=secrets.token_bytes(32)))


def test_duplicated_keys_are_refused():
    session = Session()
    a, b, c = session.advertise()
    copied = replace(b, c_public=a.c_public)  # even with b's valid signature over the copy it would clash
    with pytest.raises(ProtocolViolation, match="already in use"):
        session.clients["s02"].share([a, copied, c])
    with pytest.raises(ProtocolViolation, match="two key sets"):
        session.clients["s01"].share([a, b, b, c])
    fresh = Session()
    first = fresh.clients["s00"].advertise()
    fresh.server.add_keys("s00", first)
    with pytest.raises(ProtocolViolation, match="in the name of"):
        fresh.server.add_keys("s01", first)
    theirs = fresh.clients["s01"].advertise()
    with pytest.raises(ProtocolViolation, match="already uses"):
        fresh.server.add_keys("s01", replace(theirs, s_public=first.s_public))
    with pytest.raises(ProtocolViolation, match="already advertised other keys"):
        fresh.server.add_keys("s00", replace(first, c_public=b"x" * 32))


def test_key_lists_that_drop_alter_or_add_silos_are_refused():
    session = Session()
    advertised = session.advertise()
    with pytest.raises(ProtocolViolation, match="own keys"):
        session.clients["s00"].share(advertised[1:])
    outsider = replace(advertised[2], silo="intruder")
    with pytest.raises(ProtocolViolation, match="not a participant"):
        session.clients["s01"].share([*advertised[:2], outsider])


def sent_envelopes(session: Session) -> tuple[dict[str, list[Envelope]], dict[str, Inbox]]:
    advertised = session.advertise()
    sent = {u: c.share(advertised) for u, c in session.clients.items()}
    for u, envelopes in sent.items():
        session.server.add_envelopes(u, envelopes)
    return sent, session.server.close_shares()


def test_an_envelope_from_someone_else_is_refused_by_the_aggregator():
    session = Session()
    advertised = session.advertise()
    envelopes = session.clients["s00"].share(advertised)
    with pytest.raises(ProtocolViolation, match="must send one envelope"):
        session.server.add_envelopes("s00", [replace(e, sender="s01") for e in envelopes])
    with pytest.raises(ProtocolViolation, match="must send one envelope"):
        session.server.add_envelopes("s00", envelopes[:1])  # one holder left without its shares


@pytest.mark.parametrize(
    ("silo", "tamper", "refusal"),
    [
        ("s02", lambda e: e, "misrouted"),  # s00's envelope for s01, handed to s02
        ("s01", lambda e: replace(e, sender="s02"), "authentication"),  # sealed by s00, claims s02
        (
            "s01",
            lambda e: replace(e, ciphertext=e.ciphertext[:-1] + bytes([e.ciphertext[-1] ^ 1])),
            "authentication",
        ),
    ],
)
def test_misrouted_forged_and_tampered_envelopes_are_refused(silo, tamper, refusal):
    session = Session()
    sent, inboxes = sent_envelopes(session)
    bad = tamper(next(e for e in sent["s00"] if e.recipient == "s01"))
    with pytest.raises(ProtocolViolation, match=refusal):
        session.clients[silo].masked_input(Inbox(inboxes[silo].survivors, (bad,)), session.inputs[silo])


def test_a_replay_from_an_earlier_round_is_refused():
    earlier = Session(round_id="r1.a1")
    old_sent, _ = sent_envelopes(earlier)
    old_keys = [earlier.server._keys[u] for u in earlier.spec.participants]

    def later() -> Session:  # the same silos and identities, a later round
        now = Session(round_id="r2.a1")
        now.keys, now.peers = earlier.keys, earlier.peers
        now.clients = {u: now.client(u, now.spec) for u in now.spec.participants}
        now.server = SecAggServer(now.spec, peers=now.peers)
        return now

    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        later().server.add_keys("s00", old_keys[0])
    now = later()
    now.clients["s00"].advertise()
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        now.clients["s00"].share(old_keys)
    now = later()
    _, inboxes = sent_envelopes(now)
    replayed = tuple(e for u in ("s01", "s02") for e in old_sent[u] if e.recipient == "s00")
    with pytest.raises(ProtocolViolation, match="authentication"):
        now.clients["s00"].masked_input(Inbox(inboxes["s00"].survivors, replayed), now.inputs["s00"])


def test_silos_shown_different_models_refuse_to_unmask():
    session = Session(4)
    other_view = replace(session.spec, binding=b"another state")  # what the aggregator showed s03
    session.clients["s03"] = session.client("s03", other_view)
    survivors = session.through_masking()  # keys and shares do not depend on the model
    signatures = {u: c.consistency(survivors) for u, c in session.clients.items()}
    with pytest.raises(ProtocolViolation, match="signature does not verify"):
        session.server.add_signature("s03", signatures["s03"])
    with pytest.raises(ProtocolViolation, match="different view"):
        session.clients["s00"].unmask(signatures)
    with pytest.raises(ProtocolViolation, match="different view"):
        session.clients["s03"].unmask(signatures)


def test_a_silo_told_a_peer_dropped_while_others_count_it_reveals_nothing():
    """The attack double masking alone cannot stop: claim s00 left, to get its mask-key shares from s03 while
    collecting its self-mask shares from the others. The consistency signatures expose the split view."""
    session = Session(4)
    survivors = session.through_masking()
    signatures = {u: session.clients[u].consistency(survivors) for u in ("s00", "s01", "s02")}
    signatures["s03"] = session.clients["s03"].consistency(("s01", "s02", "s03"))
    with pytest.raises(ProtocolViolation, match="different view"):
        session.clients["s00"].unmask(signatures)
    with pytest.raises(ProtocolViolation, match="outside the survivor set"):
        session.clients["s03"].unmask(signatures)
    with pytest.raises(ProtocolViolation, match="different view"):
        session.clients["s02"].unmask({u: sig for u, sig in signatures.items() if u != "s00"})
    assert session.clients["s03"].survivors == ("s01", "s02", "s03")


def test_no_silo_reveals_both_shares_of_a_peer_and_unmasking_happens_once(monkeypatch):
    reveals: list[tuple[str, Reveal]] = []
    add = SecAggServer.add_reveal
    monkeypatch.setattr(
        SecAggServer, "add_reveal", lambda self, u, r: (reveals.append((u, r)), add(self, u, r))
    )
    spec = SessionSpec("r1.a1", "contribution", ids(7), WORDS)  # t = 5: two may leave
    inputs = random_inputs(spec, 1)
    summed, u3 = run_session(spec, inputs, dropouts={"s05": "masked", "s06": "consistency"})
    assert np.array_equal(summed, total(inputs[u] for u in u3))
    self_mask = {o for _, r in reveals for o in r.self_mask}
    mask_key = {o for _, r in reveals for o in r.mask_key}
    assert mask_key == {"s05"}
    assert "s06" in self_mask  # its input arrived: only its self-mask seed is rebuilt
    assert not self_mask & mask_key
    session = Session()
    survivors = session.through_masking()
    signatures = {u: c.consistency(survivors) for u, c in session.clients.items()}
    session.clients["s00"].unmask(signatures)
    with pytest.raises(StageError):
        session.clients["s00"].unmask(signatures)


def test_the_server_refuses_out_of_turn_repeated_and_misaddressed_messages():
    session = Session()
    with pytest.raises(StageError, match="not 'shares'"):
        session.server.add_envelopes("s00", [])
    with pytest.raises(StageError, match="not expected"):
        session.server.add_keys("intruder", Session().clients["s00"].advertise())
    _, inboxes = sent_envelopes(session)
    upload = session.clients["s00"].masked_input(inboxes["s00"], session.inputs["s00"])
    with pytest.raises(ProtocolViolation, match="a masked input has"):
        session.server.add_masked("s00", upload[:-1])
    session.server.add_masked("s00", upload)
    session.server.add_masked("s00", upload.copy())  # the same bytes again (a resend) are accepted once
    with pytest.raises(ProtocolViolation, match="another masked input"):
        session.server.add_masked("s00", upload + np.uint64(1))
    for u in ("s01", "s02"):
        session.server.add_masked(u, session.clients[u].masked_input(inboxes[u], session.inputs[u]))
    survivors = session.server.close_masked()
    for u, c in session.clients.items():
        session.server.add_signature(u, c.consistency(survivors))
    signatures = session.server.close_consistency()
    reveal = session.clients["s00"].unmask(signatures)
    with pytest.raises(ProtocolViolation, match="wrong silos"):
        session.server.add_reveal(
            "s00", Reveal(reveal.self_mask, {"s01": next(iter(reveal.self_mask.values()))})
        )
    session.server.add_reveal("s00", reveal)
    for u in ("s01", "s02"):
        session.server.add_reveal(u, session.clients[u].unmask(signatures))
    assert np.array_equal(session.server.close_unmask(), total(session.inputs.values()))


def test_one_masked_upload_looks_uniform_and_unrelated_to_its_input():
    words = 20_000
    spec = SessionSpec("r1.a1", "contribution", ids(3), words)
    session = Session()
    session.spec = spec
    session.clients = {u: session.client(u, spec) for u in spec.participants}
    session.server = SecAggServer(spec, peers=session.peers)
    ramp = np.arange(words, dtype=np.uint64) * np.uint64(1000)  # a structured plaintext
    session.inputs = {u: ramp.copy() for u in spec.participants}
    inboxes = session.share(session.advertise())
    upload = session.clients["s00"].masked_input(inboxes["s00"], ramp)
    assert not np.array_equal(upload, ramp)
    counts = np.bincount((upload >> np.uint64(56)).astype(np.int64), minlength=256)
    chi2 = float(((counts - words / 256) ** 2 / (words / 256)).sum())
    assert chi2 < 340  # 255 degrees of freedom: P(chi2 > 340) < 0.001 for uniform bytes
    r = np.corrcoef(upload.astype(np.float64), ramp.astype(np.float64))[0, 1]
    assert abs(r) < 0.05


def test_session_specs_refuse_unsafe_settings():
    assert [default_threshold(n) for n in (2, 3, 4, 5, 10, 30)] == [2, 3, 3, 4, 7, 21]
    with pytest.raises(SecAggError, match="majority"):
        SessionSpec("r", "contribution", ids(4), 4, threshold=2)  # two colluding halves could both unmask
    with pytest.raises(SecAggError, match="majority"):
        SessionSpec("r", "contribution", ids(4), 4, threshold=5)
    with pytest.raises(SecAggError, match="even"):
        SessionSpec("r", "contribution", ids(8), 4, neighbours=3)
    with pytest.raises(SecAggError, match="sorted"):
        SessionSpec("r", "contribution", ("b", "a"), 4)
    with pytest.raises(SecAggError, match="distinct"):
        SessionSpec("r", "contribution", ("a",), 4)
    with pytest.raises(SecAggError, match="purpose"):
        SessionSpec("r", "gossip", ids(3), 4)


# --- the tail guard -----------------------------------------------------------------------------------

GUARDED = Schema((Field("grad", (4, 3), 10.0, per_class=True), Field("n", (), 100.0, frac_bits=0)))


def test_presence_and_zeroing_act_on_per_class_rows_only():
    grad = torch.zeros(4, 3, dtype=torch.float64)
    grad[1, 2], grad[3, 0] = 0.5, -1.0
    flat = GUARDED.flatten({"grad": grad, "n": torch.tensor(7.0, dtype=torch.float64)})
    assert tail_guard.presence(GUARDED, flat).tolist() == [0, 1, 0, 1]
    zeroed = GUARDED.unflatten(tail_guard.zero_classes(GUARDED, flat, [3]))
    assert zeroed["grad"][3].abs().sum() == 0
    assert zeroed["grad"][1, 2] == 0.5
    assert float(zeroed["n"]) == 7.0  # not a per-class field
    assert tail_guard.held_back(np.array([0, 1, 2, 5], dtype=np.uint64), 2) == [1]
    assert tail_guard.held_back(np.array([0, 1, 2, 5], dtype=np.uint64), 3) == [1, 2]


def test_the_layer_releases_no_class_held_by_fewer_than_k_min_silos():
    holdings = [(0, 1), (0, 1, 2), (0, 3)]
    contributions = []
    for classes in holdings:
        grad = torch.zeros(4, 3, dtype=torch.float64)
        grad[list(classes)] = 1.0
        contributions.append(GUARDED.contribution(grad=grad, n=1.0))
    guarded = SecAggSum()
    sums = guarded.aggregate(GUARDED, contributions)
    assert guarded.held_back == [2, 3]
    assert sums["grad"][:, 0].tolist() == [3.0, 2.0, 0.0, 0.0]
    unguarded = SecAggSum(SecAggSettings(k_min=1))
    assert unguarded.aggregate(GUARDED, contributions)["grad"][:, 0].tolist() == [3.0, 2.0, 1.0, 1.0]
    assert unguarded.held_back == []


def test_per_class_fields_must_share_one_class_axis():
    with pytest.raises(ValueError, match="class axis"):
        Schema((Field("a", (4, 2), 1.0, per_class=True), Field("b", (5,), 1.0, per_class=True)))
    assert GUARDED.classes == 4
