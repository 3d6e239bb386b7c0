"""The `blind` layer probed as its aggregator, alone or with one silo, would probe it (issue 33).

Each guarantee is attacked first. Where a defence can be switched off here (the output mask made a no-op,
secagg's or the pair masks made no-ops, the mask label stripped of the session's key list) the attack is shown
to work, so the test can fail; then the real halves are shown to stop it. "Uniform" is a byte-frequency
chi-square test at significance `ALPHA`, run once per input seed of `SEEDS`: each encoded input it is given
fails it, each masked vector must pass.

The bound the layer states, and what these tests hold it to: the aggregator alone reads neither an input nor
any sum; the aggregator with one silo (which holds the output key) reads the sums, that is the model, and
still no single input, because secagg's pairwise masks (and, for the evaluation counts, the pair masks) stay
on it. Under ckks, by contrast, every silo holds the whole secret key, so that same collusion decrypts every
silo's upload.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import event, given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from fedlt.aggregation import Contribution, Field, Schema
from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    BadMessage,
    Released,
    SiloHalf,
    SiloSide,
    SumAborted,
    SumSpec,
    WrongStage,
    evaluation_schema,
)
from privacy.blind import halves as blind_halves
from privacy.blind.halves import BlindSiloHalf, BlindTotal, CountsTotal, MaskedCounts
from privacy.blind.keys import MASK_INFO, OutputKey, Withheld, read_public, remove_masks, sum_label
from privacy.blind.layer import BlindSettings, BlindSum
from privacy.crypto import transcript
from privacy.ring import FixedPointCodec, Ring, apply_masks
from privacy.secagg import protocol
from privacy.secagg.halves import codec_of
from privacy.secagg.layer import SecAggSum
from privacy.secagg.local import STAGES
from privacy.secagg.protocol import MaskedInput, SecAggClient, SurvivorList, Transcript, default_threshold
from privacy.secagg.settings import SecAggSettings

ALPHA = 1e-6  # per check: the fifty-odd checks of this file fail by chance less than once in 10^4 runs
CRITICAL = float(chi2.isf(ALPHA, 255))  # 256 byte values: 255 degrees of freedom
SEEDS = (0, 1, 2)
FOUR = ("silo-a", "silo-b", "silo-c", "silo-d")
COLLUDER = "silo-a"
BINDING = b"the RoundSpec's hash and the state trained from"

# the aggregator's view: a model delta of 16 KiB in the ring, enough bytes for the chi-square (64 a bin)
WIDE_VIEW = Schema((Field("delta", (4096,), 10.0, frac_bits=24),))
CLASSES = 1024  # evaluation counts: 2 × 1024 64-bit words, 16 KiB


def chi_square(raw: bytes | np.ndarray) -> float:
    counts = np.bincount(np.frombuffer(bytes(raw), dtype=np.uint8), minlength=256)
    expected = counts.sum() / 256
    return float(((counts - expected) ** 2 / expected).sum())


def uniform(raw: bytes | np.ndarray) -> bool:
    return chi_square(raw) < CRITICAL


def ring_vector(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).copy()


def minus(ring: Ring, a: np.ndarray | bytes, b: np.ndarray | bytes) -> np.ndarray:
    """a − b in the ring, word by word."""
    out = ring_vector(bytes(a))
    for into, part in zip(ring.parts(out), ring.parts(ring_vector(bytes(b))), strict=True):
        np.subtract(into, part, out=into)
    return out


def encoded_sum(
    codec: FixedPointCodec, vectors: Mapping[str, torch.Tensor], silos: tuple[str, ...]
) -> np.ndarray:
    """The reference: Σ of the silos' encodings in the ring, added here without any mask."""
    total = codec.ring.zeros()
    for u in silos:
        codec.ring.add(total, codec.encode(vectors[u]))
    return total


def bits(vector: torch.Tensor) -> bytes:
    return vector.numpy().tobytes()


# --- one sum, its halves driven by hand ----------------------------------------------------------------

Tamper = Callable[[str, object], object]


@dataclass
class Played:
    """One sum as the test saw it: what the aggregator took and released, and what each silo read."""

    released: Released
    aggregator: AggregatorHalf
    halves: dict[str, SiloHalf]
    uploads: dict[str, np.ndarray]  # each silo's masked input as the aggregator received it
    handed: bytes | None  # the blind total the aggregator handed to the silos
    read: dict[str, torch.Tensor]  # the sum each silo read itself


def answers(dropouts: Mapping[str, str], silo: str, stage: str) -> bool:
    """Whether `silo` answers `stage`; the stages after the unmask stage (the blind total, a census's
    transcript) reach only silos that never dropped out."""
    at = STAGES.index(stage) if stage in STAGES else len(STAGES)
    return silo not in dropouts or STAGES.index(dropouts[silo]) > at


def play(
    sides: Mapping[str, SiloSide],
    aggregator_side: AggregatorSide,
    spec: SumSpec,
    vectors: Mapping[str, torch.Tensor],
    dropouts: Mapping[str, str] | None = None,
    tamper: Tamper = lambda _, step: step,
) -> Played:
    """One sum, every message delivered at once; each silo of `dropouts` stops at its stage (as
    `privacy.secagg.local`), and `tamper` changes what the aggregator sends a silo."""
    dropouts = dropouts or {}
    halves = {u: sides[u].half(spec, u, may_release=lambda _: None) for u in spec.silos}
    aggregator = aggregator_side.half(spec)
    uploads: dict[str, np.ndarray] = {}
    handed = None
    outbox = {u: halves[u].start(vectors[u]) for u in spec.silos if answers(dropouts, u, "keys")}
    while True:
        for u, messages in outbox.items():
            for message in messages:
                if isinstance(message, MaskedInput):
                    uploads[u] = message.vector.copy()
                aggregator.receive(u, message)
        out = aggregator.close()
        if isinstance(out, Released):
            read = {u: h.result for u, h in halves.items() if h.done and h.result is not None}
            return Played(out, aggregator, halves, uploads, handed, read)
        handed = next((s.total for s in out.values() if isinstance(s, BlindTotal)), handed)
        stage = aggregator.stage
        outbox = {u: halves[u].step(tamper(u, s)) for u, s in out.items() if answers(dropouts, u, stage)}


def blind_sides(silos: tuple[str, ...]) -> tuple[Mapping[str, SiloSide], AggregatorSide, OutputKey]:
    """The layer's in-process sides, and the output key their silos share."""
    sides, aggregator_side = BlindSum().in_process(silos)
    return sides, aggregator_side, sides[silos[0]].key_for(None)


def spec_of(
    silos: tuple[str, ...],
    schema: Schema,
    purpose: str = "contribution",
    *,
    round_id: str = "r1.a1",
    binding: bytes = BINDING,
) -> SumSpec:
    return SumSpec(round_id, purpose, silos, schema, binding, BlindSettings())


def small_inputs(seed: int) -> dict[str, torch.Tensor]:
    """Model deltas of the usual size: their encodings are far from uniform (top bytes 0x00 or 0xff)."""
    generator = torch.Generator().manual_seed(seed)
    return {u: 0.01 * torch.randn(WIDE_VIEW.size, generator=generator, dtype=torch.float64) for u in FOUR}


def blind_contribution(vectors: Mapping[str, torch.Tensor]) -> tuple[Played, OutputKey]:
    sides, aggregator_side, key = blind_sides(FOUR)
    return play(sides, aggregator_side, spec_of(FOUR, WIDE_VIEW), vectors), key


# --- 1. the same sum as secagg, to the bit, whoever drops out --------------------------------------------

SCHEMA = Schema(
    (
        Field("delta", (4,), 10.0, frac_bits=24),  # 32-bit words at its own precision
        Field("scaled", (2,), 300.0, frac_bits=24),  # 32-bit words at fewer bits, rounded stochastically
        Field("wide", (2,), 1e9, frac_bits=24),  # 64-bit words
        Field("grad", (3, 2), 4.0, frac_bits=24, per_class=True),
        Field("n", (), 1e4, frac_bits=0),
    )
)


LAYERS = {"blind": (BlindSum, BlindSettings), "secagg": (SecAggSum, SecAggSettings)}


def outcome(layer: str, spec: SumSpec, threshold: int, vectors, dropouts: Mapping[str, str]) -> tuple:
    """('sum', survivors, the sum every reader read: the aggregator under secagg, each silo that stayed under
    blind), or ('aborted', the error), of `spec` under `layer` with `threshold`."""
    make, settings_of = LAYERS[layer]
    sides, aggregator_side = make().in_process(spec.silos)
    spec = replace(spec, settings=settings_of(threshold=threshold))
    try:
        played = play(sides, aggregator_side, spec, vectors, dropouts)
    except SumAborted as exc:
        return ("aborted", type(exc).__name__, str(exc))
    sums = {bits(total) for total in played.read.values()}
    if layer == "blind":
        assert played.released.total is None  # the aggregator reads no sum
        assert set(played.read) == {u for u in spec.silos if u not in dropouts}
    else:
        sums.add(bits(played.released.total))
    assert len(sums) == 1, "every reader reads the same sum"
    return ("sum", played.released.survivors, sums.pop())


def completes(silos: tuple[str, ...], t: int, dropouts: Mapping[str, str]) -> bool:
    """secagg's promise over the complete graph: every stage keeps at least t silos."""
    return all(sum(answers(dropouts, u, stage) for u in silos) >= t for stage in STAGES)


def assert_same_sum(
    silos: tuple[str, ...], purpose: str, threshold: int, vectors, dropouts: Mapping[str, str]
) -> None:
    """Both layers' outcomes are equal; a completed one is Σ of U3's encodings, decoded."""
    spec = SumSpec("r1.a1", purpose, silos, SCHEMA, BINDING)
    blind, secagg = (outcome(layer, spec, threshold, vectors, dropouts) for layer in LAYERS)
    assert blind == secagg
    if not completes(silos, threshold or default_threshold(len(silos)), dropouts):
        assert blind[0] == "aborted"
        return
    u3 = tuple(u for u in silos if answers(dropouts, u, "masked"))
    codec = codec_of(spec)
    assert blind == ("sum", u3, bits(codec.decode(encoded_sum(codec, vectors, u3))))


def values(field: Field) -> st.SearchStrategy[list[float]]:
    """Any values, negative ones too, some beyond the bound (clipped)."""
    edge = 1.25 * field.bound
    return st.lists(st.floats(-edge, edge), min_size=field.size, max_size=field.size)


@st.composite
def blind_cases(draw) -> tuple[tuple[str, ...], str, int, dict[str, torch.Tensor], dict[str, str]]:
    n = draw(st.integers(3, 8))
    silos = tuple(f"silo-{i}" for i in range(n))
    threshold = draw(st.sampled_from([0, *range(n // 2 + 1, n + 1)]))
    spare = n - (threshold or default_threshold(n))
    vectors = {
        u: torch.tensor([x for f in SCHEMA.fields for x in draw(values(f))], dtype=torch.float64)
        for u in silos
    }
    size = draw(st.sampled_from([spare, n]))  # within the threshold, or any number of dropouts
    dropouts = draw(st.dictionaries(st.sampled_from(silos), st.sampled_from(STAGES), max_size=size))
    return silos, draw(st.sampled_from(["census", "contribution"])), threshold, vectors, dropouts


@given(blind_cases())
@settings(max_examples=25, deadline=None)
def test_every_silo_that_stays_reads_secaggs_sum_to_the_bit_or_the_sum_aborts_as_secaggs(case):
    silos, purpose, threshold, vectors, dropouts = case
    event("completes" if completes(silos, threshold or default_threshold(len(silos)), dropouts) else "aborts")
    assert_same_sum(silos, purpose, threshold, vectors, dropouts)


def spread(ids: tuple[str, ...]) -> list[str]:
    """Silos from both ends inwards, so dropouts hit both signs of the pairwise masks."""
    return [ids[i // 2] if i % 2 == 0 else ids[-1 - i // 2] for i in range(len(ids))]


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_tolerates_n_minus_t_dropouts_and_aborts_with_one_more_as_secagg(n, stage):
    silos = tuple(f"silo-{i}" for i in range(n))
    generator = torch.Generator().manual_seed(n)
    vectors = {u: 20 * torch.rand(SCHEMA.size, generator=generator, dtype=torch.float64) - 10 for u in silos}
    spare = spread(silos)[: n - default_threshold(n) + 1]
    for purpose in ("census", "contribution"):
        assert_same_sum(silos, purpose, 0, vectors, dict.fromkeys(spare[:-1], stage))
        assert_same_sum(silos, purpose, 0, vectors, dict.fromkeys(spare, stage))


# --- 2. the aggregator alone: every vector it holds is uniform to it --------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_the_aggregator_alone_holds_uniform_uploads_and_a_uniform_total(seed):
    inputs = small_inputs(seed)
    played, _ = blind_contribution(inputs)
    codec = codec_of(played.aggregator.spec)
    for u in FOUR:
        assert not uniform(codec.encode(inputs[u]))  # the test tells an input from noise...
        assert uniform(played.uploads[u])  # ...and what the aggregator received passes it
    assert not uniform(encoded_sum(codec, inputs, FOUR))
    assert uniform(played.handed)
    assert played.released == Released(FOUR, None, readers=FOUR)


@pytest.mark.parametrize("seed", SEEDS)
def test_two_totals_differ_by_noise_not_by_the_inputs_difference(seed):
    """An aggregator that runs two sums cannot subtract their totals to learn how the inputs changed."""
    first, second = small_inputs(seed), small_inputs(seed + len(SEEDS))
    codec = FixedPointCodec(WIDE_VIEW, max_silos=len(FOUR))
    inputs_moved = minus(codec.ring, encoded_sum(codec, first, FOUR), encoded_sum(codec, second, FOUR))
    assert not uniform(inputs_moved)
    totals_moved = minus(
        codec.ring, blind_contribution(first)[0].handed, blind_contribution(second)[0].handed
    )
    assert uniform(totals_moved)
    assert not np.array_equal(totals_moved, inputs_moved)


def test_without_the_output_mask_the_aggregators_total_is_the_sum(monkeypatch):
    """The attack, with the defence switched off: the total decodes to the model update, and two totals
    subtract to the inputs' difference."""
    monkeypatch.setattr(blind_halves, "add_mask", lambda *args: None)
    first, second = small_inputs(0), small_inputs(1)
    codec = FixedPointCodec(WIDE_VIEW, max_silos=len(FOUR))
    handed = [blind_contribution(inputs)[0].handed for inputs in (first, second)]
    truth = encoded_sum(codec, first, FOUR)
    assert bits(codec.decode(ring_vector(handed[0]))) == bits(codec.decode(truth))
    assert not uniform(handed[0])
    moved = minus(codec.ring, truth, encoded_sum(codec, second, FOUR))
    assert np.array_equal(minus(codec.ring, *handed), moved)


# --- 3. the aggregator with one silo: the sums, never one input ------------------------------------------


def colluders_view(played: Played) -> tuple[Ring, bytes]:
    """The ring and the label of the sum's output masks, as the aggregator knows them (it closed the key list
    the label binds); with the output key, from its colluding silo, it draws every mask."""
    session = played.aggregator.server.spec
    return session.ring, sum_label(session.round_id, session.purpose, session.binding, session.keys_digest)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_aggregator_with_one_silo_reads_the_sum_and_no_single_input(seed):
    inputs = small_inputs(seed)
    played, key = blind_contribution(inputs)
    ring, label = colluders_view(played)
    codec = codec_of(played.aggregator.spec)
    total = ring_vector(played.handed)
    remove_masks(ring, total, key, label, played.released.survivors)
    assert np.array_equal(total, encoded_sum(codec, inputs, FOUR))  # the model: the layer's stated bound
    for victim in FOUR[1:]:
        upload = played.uploads[victim].copy()
        remove_masks(ring, upload, key, label, [victim])
        assert uniform(upload)  # secagg's pairwise and self masks still cover it
        assert not np.array_equal(upload, codec.encode(inputs[victim]))


def test_without_secaggs_masks_the_colluding_silo_would_read_each_input(monkeypatch):
    """The attack, with secagg's masks switched off: the output mask alone is no cover from a silo that
    holds the key."""
    monkeypatch.setattr(protocol, "apply_masks", lambda *args: None)
    inputs = small_inputs(0)
    played, key = blind_contribution(inputs)
    ring, label = colluders_view(played)
    codec = codec_of(played.aggregator.spec)
    upload = played.uploads["silo-b"].copy()
    remove_masks(ring, upload, key, label, ["silo-b"])
    assert np.array_equal(upload, codec.encode(inputs["silo-b"]))


# --- 4. tampering and replay ---------------------------------------------------------------------------


def resized(by: int) -> Tamper:
    """The blind total one byte shorter or longer than the ring."""

    def tamper(_: str, step: object) -> object:
        if not isinstance(step, BlindTotal):
            return step
        return BlindTotal(step.total[:by] if by < 0 else step.total + bytes(by))

    return tamper


def instead_of(kind: type) -> Tamper:
    """A zero total of the ring's size where the aggregator should send a `kind`."""
    nbytes = FixedPointCodec(WIDE_VIEW, max_silos=len(FOUR)).ring.nbytes
    return lambda _, step: BlindTotal(bytes(nbytes)) if isinstance(step, kind) else step


@pytest.mark.parametrize(
    ("purpose", "tamper", "refusal"),
    [
        ("contribution", resized(-1), (BadMessage, "blind total of")),
        ("contribution", resized(1), (BadMessage, "blind total of")),
        ("census", instead_of(Transcript), (WrongStage, "recomputes the sum itself")),
        ("contribution", instead_of(SurvivorList), (WrongStage, "has not signed one")),
    ],
    ids=["short", "long", "for a census", "before signing"],
)
def test_a_blind_total_of_the_wrong_size_or_at_the_wrong_time_is_refused(purpose, tamper, refusal):
    sides, aggregator_side, _ = blind_sides(FOUR)
    error, match = refusal
    with pytest.raises(error, match=match):
        play(sides, aggregator_side, spec_of(FOUR, WIDE_VIEW, purpose), small_inputs(0), tamper=tamper)


def test_a_blind_total_replayed_to_a_silo_that_read_one_is_refused():
    played, _ = blind_contribution(small_inputs(0))
    with pytest.raises(WrongStage, match="blind total where"):
        played.halves["silo-b"].step(BlindTotal(played.handed))
    with pytest.raises(WrongStage, match="nothing to close"):
        played.aggregator.close()


def test_the_aggregator_hands_the_total_only_to_silos_that_signed_for_it():
    sides, aggregator_side, _ = blind_sides(FOUR)
    dropouts = {"silo-d": "consistency"}
    played = play(sides, aggregator_side, spec_of(FOUR, WIDE_VIEW), small_inputs(0), dropouts)
    assert played.released.survivors == FOUR  # silo-d's input is in the sum: it dropped after uploading
    assert set(played.read) == {"silo-a", "silo-b", "silo-c"}
    assert played.aggregator.download("silo-a") == played.handed
    with pytest.raises(WrongStage, match="no blind total for silo-d"):
        played.aggregator.download("silo-d")


def test_a_new_attempt_of_the_same_round_draws_new_output_masks():
    """Same output key, round id, purpose and binding, new session keys: the totals of two attempts do not
    subtract to the inputs' difference."""
    sides, aggregator_side, _ = blind_sides(FOUR)
    first, second = small_inputs(0), small_inputs(1)
    spec = spec_of(FOUR, WIDE_VIEW)
    attempts = [play(sides, aggregator_side, spec, inputs) for inputs in (first, second)]
    codec = codec_of(spec)
    moved = minus(codec.ring, encoded_sum(codec, first, FOUR), encoded_sum(codec, second, FOUR))
    labels = [colluders_view(played)[1] for played in attempts]
    assert labels[0] != labels[1]
    totals_moved = minus(codec.ring, *(played.handed for played in attempts))
    assert uniform(totals_moved)
    assert not np.array_equal(totals_moved, moved)


def test_masks_not_bound_to_the_session_would_give_the_inputs_difference(monkeypatch):
    """The attack, with the key list left out of the mask's label: a retried round reuses every mask."""

    def unbound(half: BlindSiloHalf) -> bytes:
        session = half.client.spec
        return sum_label(session.round_id, session.purpose, session.binding)

    monkeypatch.setattr(BlindSiloHalf, "_label", unbound)
    sides, aggregator_side, _ = blind_sides(FOUR)
    first, second = small_inputs(0), small_inputs(1)
    spec = spec_of(FOUR, WIDE_VIEW)
    attempts = [play(sides, aggregator_side, spec, inputs) for inputs in (first, second)]
    codec = codec_of(spec)
    moved = minus(codec.ring, encoded_sum(codec, first, FOUR), encoded_sum(codec, second, FOUR))
    assert np.array_equal(minus(codec.ring, *(played.handed for played in attempts)), moved)


def test_the_aggregator_takes_no_bytes_of_the_output_key():
    assert isinstance(read_public(b""), Withheld)
    assert OutputKey.new().public_bytes() == b""
    with pytest.raises(ValueError, match="no public part"):
        read_public(b"x")


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_an_output_key_of_the_wrong_length_is_refused(length):
    with pytest.raises(ValueError, match="32 bytes"):
        OutputKey(bytes(length))


def rfc5869(key: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 with no salt, 32 bytes, written out from RFC 5869 (extract, then one expand block)."""
    prk = hmac.new(bytes(32), key, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


KEY = bytes(range(32))
KEY_ID = "3ecb928f6058c606e125f3993c86987a23bc2c88597f7779414a0e8f7cde22b9"
MASK_KEY = "ecb3d1af43e7c48ce4745f88951b4fe22876765f105ff1b62c0765b1725c831a"


def test_derived_keys_are_hkdf_sha256_bound_to_the_key_id():
    """A known answer, checked against HKDF as `cryptography` computes it with the RFC's explicit zero salt
    and as RFC 5869 writes it out: a changed derivation would leave silos unable to open states sealed
    before it."""
    key = OutputKey(KEY)
    assert key.context_id == hashlib.sha256(b"fedlt/blind/key-id/v1" + KEY).hexdigest() == KEY_ID
    info = MASK_INFO + KEY_ID.encode()
    salted = HKDF(hashes.SHA256(), length=32, salt=bytes(32), info=info).derive(KEY)
    assert key.derived_key(MASK_INFO) == salted == rfc5869(KEY, info) == bytes.fromhex(MASK_KEY)
    assert key.derived_key(b"fedlt/blind/sealing/v1") != key.derived_key(MASK_INFO)


# --- 5. the evaluation sum ---------------------------------------------------------------------------------

EVALUATION = evaluation_schema(CLASSES)
PAIR_LABEL = "fedlt/blind/evaluation-pair/v1"


def held_out_counts(seed: int) -> dict[str, torch.Tensor]:
    """Each silo's test counts per class, right then total."""
    rng = np.random.default_rng(seed)
    counts = {}
    for u in FOUR:
        total = rng.integers(0, 60, CLASSES)
        counts[u] = torch.from_numpy(np.concatenate([rng.integers(0, total + 1), total]).astype(np.float64))
    return counts


@dataclass
class Evaluated:
    """An evaluation sum closed once, and what silos that collude with the aggregator would bring to it: the
    output key and their clients of the round's contribution session (its pair seeds)."""

    aggregator: AggregatorHalf
    halves: dict[str, SiloHalf]
    uploads: dict[str, bytes]  # each silo's masked counts
    totals: dict[str, CountsTotal]
    released_for: list[tuple[str, ...]]  # what the silos' release gates were asked, in order
    key: OutputKey
    sessions: dict[str, SecAggClient]


def evaluate(
    counts: Mapping[str, torch.Tensor],
    *,
    silent: tuple[str, ...] = (),
    tamper: Callable[[CountsTotal], CountsTotal] = lambda total: total,
) -> Evaluated:
    """A blind contribution, then the evaluation sum of the state stepped from it over the same silos; the
    `silent` silos send no counts, and `tamper` changes the total the aggregator hands back."""
    sides, aggregator_side, key = blind_sides(FOUR)
    contribution = play(sides, aggregator_side, spec_of(FOUR, WIDE_VIEW), small_inputs(0))
    spec = spec_of(FOUR, EVALUATION, "evaluation", binding=b"the stepped state's digest")
    released_for: list[tuple[str, ...]] = []
    halves = {u: sides[u].half(spec, u, may_release=released_for.append) for u in FOUR}
    aggregator = aggregator_side.half(spec)
    uploads = {}
    for u in FOUR:
        (upload,) = halves[u].start(counts[u])
        uploads[u] = upload.vector
        if u not in silent:
            aggregator.receive(u, upload)
    totals = aggregator.close()
    for u, total in totals.items():
        halves[u].step(tamper(total))
    sessions = {u: half.client for u, half in contribution.halves.items()}
    return Evaluated(aggregator, halves, uploads, totals, released_for, key, sessions)


def test_every_silo_reads_the_true_per_class_counts_released_only_over_every_silo():
    counts = held_out_counts(0)
    evaluated = evaluate(counts)
    assert evaluated.released_for == [FOUR] * len(FOUR)
    for u in FOUR:
        assert evaluated.halves[u].counted == FOUR
        assert torch.equal(evaluated.halves[u].result, sum(counts.values()))
    assert evaluated.aggregator.close() == Released(FOUR, None)


def test_one_silos_missing_counts_abort_the_sum_at_the_aggregator():
    with pytest.raises(SumAborted, match="silo-c sent no counts"):
        evaluate(held_out_counts(0), silent=("silo-c",))


@pytest.mark.parametrize(
    ("tamper", "refusal"),
    [
        (lambda total: replace(total, silos=FOUR[:3]), "other silos than those whose masks cancel"),
        (lambda total: replace(total, silos=(*FOUR, "silo-e")), "other silos than those whose masks cancel"),
        (lambda total: replace(total, total=total.total[:-8]), "evaluation total of"),
    ],
    ids=["fewer silos", "more silos", "short"],
)
def test_a_counts_total_naming_other_silos_or_of_the_wrong_size_is_refused(tamper, refusal):
    with pytest.raises(BadMessage, match=refusal):
        evaluate(held_out_counts(0), tamper=tamper)


def test_a_counts_total_replayed_to_a_silo_that_read_one_is_refused():
    evaluated = evaluate(held_out_counts(0))
    with pytest.raises(WrongStage):
        evaluated.halves["silo-b"].step(evaluated.totals["silo-b"])


@pytest.mark.parametrize(
    ("sender", "upload", "refusal"),
    [
        ("silo-e", lambda ok: ok, (WrongStage, "silo-e may not send")),
        ("silo-b", lambda ok: MaskedCounts(ok.vector[:-8]), (BadMessage, "masked counts of")),
        ("silo-b", lambda ok: MaskedCounts(bytes(len(ok.vector))), (BadMessage, "already sent other")),
        ("silo-b", lambda ok: BlindTotal(ok.vector), (WrongStage, "may not send a BlindTotal")),
    ],
    ids=["outside the sum", "short", "a second, other upload", "another message"],
)
def test_the_aggregator_takes_one_upload_of_the_rings_size_from_each_silo_of_the_sum(sender, upload, refusal):
    sides, aggregator_side, _ = blind_sides(FOUR)
    play(sides, aggregator_side, spec_of(FOUR, WIDE_VIEW), small_inputs(0))
    spec = spec_of(FOUR, EVALUATION, "evaluation")
    half = sides["silo-b"].half(spec, "silo-b", may_release=lambda _: None)
    (genuine,) = half.start(held_out_counts(0)["silo-b"])
    aggregator = aggregator_side.half(spec)
    aggregator.receive("silo-b", genuine)
    aggregator.receive("silo-b", genuine)  # the same upload again: a silo resending after a reconnect
    error, match = refusal
    with pytest.raises(error, match=match):
        aggregator.receive(sender, upload(genuine))


def test_an_evaluation_half_needs_a_contribution_session_of_its_round():
    """Its pair masks come from that session's seeds: without one there is nothing to mask with."""
    sides, aggregator_side, _ = blind_sides(FOUR)
    spec = spec_of(FOUR, EVALUATION, "evaluation")
    with pytest.raises(SumAborted, match=r"no contribution session of r1\.a1"):
        sides["silo-a"].half(spec, "silo-a", may_release=lambda _: None)
    play(sides, aggregator_side, spec_of(FOUR, WIDE_VIEW, round_id="r1.a2"), small_inputs(0))
    with pytest.raises(SumAborted, match=r"no contribution session of r1\.a1"):
        sides["silo-a"].half(spec, "silo-a", may_release=lambda _: None)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_evaluation_total_and_each_upload_are_uniform_to_the_aggregator(seed):
    counts = held_out_counts(seed)
    evaluated = evaluate(counts)
    codec = FixedPointCodec(EVALUATION, max_silos=len(FOUR))
    assert not uniform(codec.encode(counts["silo-a"]))
    assert uniform(evaluated.totals["silo-a"].total)
    assert all(uniform(upload) for upload in evaluated.uploads.values())


def test_without_the_output_mask_the_evaluation_total_is_the_counts(monkeypatch):
    monkeypatch.setattr(blind_halves, "add_mask", lambda *args: None)
    counts = held_out_counts(0)
    total = evaluate(counts).totals["silo-a"].total
    codec = FixedPointCodec(EVALUATION, max_silos=len(FOUR))
    assert torch.equal(codec.decode(ring_vector(total)), sum(counts.values()))


def counts_view(evaluated: Evaluated, victim: str, colluders: tuple[str, ...]) -> np.ndarray:
    """`victim`'s masked counts less its output mask and the pair masks it shares with `colluders`: all that
    the aggregator and those silos can take off them."""
    spec = evaluated.aggregator.spec
    ring = codec_of(spec).ring
    label = sum_label(spec.round_id, spec.purpose, spec.binding)
    view = ring_vector(evaluated.uploads[victim])
    remove_masks(ring, view, evaluated.key, label, [victim])
    pairs = [
        (evaluated.sessions[u].pair_key(victim, transcript(PAIR_LABEL, label)), victim > u) for u in colluders
    ]
    apply_masks(ring, view, pairs)  # the victim added the mask it shares with u where victim < u
    return view


def test_the_aggregator_with_one_silo_reads_no_single_silos_counts():
    counts = held_out_counts(0)
    evaluated = evaluate(counts)
    codec = FixedPointCodec(EVALUATION, max_silos=len(FOUR))
    for victim in FOUR[1:]:
        view = counts_view(evaluated, victim, (COLLUDER,))
        assert uniform(view)  # the pair masks it shares with the two honest silos remain
        assert not np.array_equal(view, codec.encode(counts[victim]))
    everyone_else = tuple(u for u in FOUR if u != "silo-b")  # the trivial bound: the sum less the others'
    assert np.array_equal(counts_view(evaluated, "silo-b", everyone_else), codec.encode(counts["silo-b"]))


def test_without_the_pair_masks_the_colluding_silo_would_read_each_silos_counts(monkeypatch):
    monkeypatch.setattr(blind_halves, "apply_masks", lambda *args: None)
    counts = held_out_counts(0)
    evaluated = evaluate(counts)
    codec = FixedPointCodec(EVALUATION, max_silos=len(FOUR))
    for victim in FOUR[1:]:
        assert np.array_equal(counts_view(evaluated, victim, ()), codec.encode(counts[victim]))


# --- 6. the simulator: blind's sums are secagg's, census and tail guard included -----------------------

GUARDED = Schema(
    (
        Field("delta", (5,), 4.0, frac_bits=24),
        Field("grad", (4, 3), 4.0, frac_bits=20, per_class=True),
        Field("counts", (4,), 1e4, frac_bits=0, per_class=True),
    )
)
HOLDINGS = ((0, 1, 2), (0, 1, 3), (0, 2), (0, 1, 2), (1, 2))  # class 3: the second silo's alone


def guarded_contributions(seed: int) -> list[Contribution]:
    generator = torch.Generator().manual_seed(seed)
    contributions = []
    for classes in HOLDINGS:
        grad, counts = torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        for c in classes:
            grad[c] = torch.randn(3, generator=generator, dtype=torch.float64)
            counts[c] = float(torch.randint(1, 50, (), generator=generator))
        delta = torch.randn(5, generator=generator, dtype=torch.float64)
        contributions.append(GUARDED.contribution(delta=delta, grad=grad, counts=counts))
    return contributions


def test_the_simulators_blind_sums_are_secaggs_to_the_bit_through_the_census():
    """The census is taken under each layer (under blind only the silos read it, so the simulator keeps none
    and reports no zeroed classes: each round takes it anew), and both zero the class one silo holds."""
    blind, secagg = BlindSum(BlindSettings(k_min=2)), SecAggSum(SecAggSettings(k_min=2))
    for seed in (0, 1):  # secagg: the first round takes the census, the second sums under it
        contributions = guarded_contributions(seed)
        sums = [layer.aggregate(GUARDED, contributions) for layer in (blind, secagg)]
        assert sums[0].contributors == sums[1].contributors == len(HOLDINGS)
        for f in GUARDED.fields:
            assert bits(sums[0][f.name]) == bits(sums[1][f.name]), f.name
        unguarded = GUARDED.unflatten(sum(c.flat() for c in contributions))
        assert unguarded["grad"][3].any()  # what the guard hides
        assert not sums[0]["grad"][3].any()
        assert not sums[0]["counts"][3].any()
        assert secagg.zeroed == [3]
    assert (blind.zeroed, blind.saved()) == ([], {})
