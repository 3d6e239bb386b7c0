"""The `ckks` layer: parameters, the two key types, sums within the stated precision, and what the aggregator
can and cannot do with what it holds."""

from __future__ import annotations

import os
import stat
import tempfile

import numpy as np
import pytest
import tenseal as ts
import torch
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema
from fedlt.aggregation.halves import BadMessage, Released, SumSpec, WrongStage
from privacy.ckks import seeded
from privacy.ckks.halves import (
    CkksAggregatorHalf,
    CkksSiloHalf,
    EncryptedSum,
    EncryptedUpload,
    SumSignatures,
    on_grid,
)
from privacy.ckks.keys import (
    COEFF_MOD_BIT_SIZES,
    POLY_MODULUS_DEGREE,
    SLOTS,
    Ciphertext,
    CkksKeyError,
    CkksOverflowRisk,
    PublicContext,
    SecretContext,
    ciphertext_limit,
    scale_bits,
)
from privacy.peers import KeyPeers, Signed
from privacy.pki.signing import sign

SCHEMA = Schema((Field("delta", (5000,), 50.0, frac_bits=20), Field("n", (), 1000.0, frac_bits=0)))
SILOS = ("a", "b", "c")
SECRET = SecretContext.new()
# every silo's signing key (its certificate key in a consortium), and the peers check that knows them all
IDENTITIES = {u: ec.generate_private_key(ec.SECP256R1()) for u in [*"abcdz", *(f"s{i}" for i in range(6))]}
PEERS = KeyPeers({u: key.public_key() for u, key in IDENTITIES.items()})


def signer(silo: str):
    return lambda data, *, context: sign(IDENTITIES[silo], data, context=context)


def silo_half(spec: SumSpec, me: str, may_release=lambda survivors: None) -> CkksSiloHalf:
    return CkksSiloHalf(spec, me, SECRET, sign=signer(me), peers=PEERS, may_release=may_release)


def aggregator_half(spec: SumSpec) -> CkksAggregatorHalf:
    return CkksAggregatorHalf(spec, SECRET.public, lambda _: b"")


def test_the_parameters_are_the_standards_128_bit_ones_and_hold_no_rotation_or_relinearisation_keys():
    """SEAL's table for 128-bit classical security at N = 8192 allows 218 bits of coefficient modulus."""
    assert POLY_MODULUS_DEGREE == 8192
    assert sum(COEFF_MOD_BIT_SIZES) <= 218
    public = ts.context_from(SECRET.public.serialized)
    assert not public.is_private()
    assert not public.has_galois_keys()
    assert not public.has_relin_keys()
    assert len(SECRET.public.serialized) < 1024  # symmetric encryption: no public key to ship


def test_the_public_context_adds_but_cannot_decrypt_or_encrypt():
    blob = SECRET.encrypt(np.ones(10), scale_bits=30)
    total = SECRET.public.add([blob, blob])
    public = ts.context_from(SECRET.public.serialized)
    with pytest.raises(ValueError, match="secret"):
        Ciphertext.parse(public, total).chunks[0].decrypt()
    with pytest.raises(ValueError, match=r"doesn.t support encryption"):
        ts.ckks_vector(public, [1.0], scale=2.0**30)
    assert np.allclose(SECRET.decrypt(total, 10), 2.0, atol=1e-5)


def test_the_secret_context_survives_its_bytes_and_a_public_one_is_refused_as_secret():
    again = SecretContext.from_secret_bytes(SECRET.secret_bytes())
    assert again.context_id == SECRET.context_id
    blob = SECRET.encrypt(np.arange(4.0), scale_bits=30)
    assert np.allclose(again.decrypt(blob, 4), np.arange(4.0), atol=1e-5)
    with pytest.raises(CkksKeyError, match="secret"):
        SecretContext.from_secret_bytes(SECRET.public.serialized)
    with pytest.raises(CkksKeyError):
        PublicContext.from_bytes(b"not a context")
    other = SecretContext.new()
    assert other.context_id != SECRET.context_id
    garbled = other.decrypt(SECRET.public.add([blob, blob]), 4)  # another consortium's key reads noise
    assert np.abs(garbled - 2 * np.arange(4.0)).min() > 1e3


def run_sum(vectors: dict[str, torch.Tensor], spec: SumSpec) -> tuple[Released, dict[str, CkksSiloHalf]]:
    aggregator = aggregator_half(spec)
    silos = {u: silo_half(spec, u) for u in vectors}
    for u, v in vectors.items():
        (upload,) = silos[u].start(v)
        aggregator.receive(u, upload)
    for stage in ("sign", "delivered"):
        steps = aggregator.close()
        assert aggregator.stage == stage
        for u, step in steps.items():
            for message in silos[u].step(step):
                aggregator.receive(u, message)
    return aggregator.close(), silos


@given(st.integers(0, 2**32 - 1), st.integers(2, 5))
@settings(max_examples=10, deadline=None)
def test_silos_decrypt_the_sum_within_the_stated_precision_and_all_alike(seed, n):
    rng = np.random.default_rng(seed)
    silos = tuple(f"s{i}" for i in range(n))
    spec = SumSpec("r1", "contribution", silos, SCHEMA, b"", None)
    vectors = {
        u: torch.from_numpy(np.append(rng.uniform(-50, 50, 5000), rng.integers(1, 1000))) for u in silos
    }
    released, halves = run_sum(vectors, spec)
    assert released == Released(silos, None)  # the aggregator releases no plaintext
    truth = sum(vectors.values())
    results = [h.result for h in halves.values()]
    assert all(torch.equal(r, results[0]) for r in results)  # bit for bit, at every silo
    # CKKS noise at this scale is far below the grid; the grid's rounding is the stated precision
    grid = on_grid(spec, truth.numpy())
    assert (results[0] - truth).abs()[:-1].max() <= 2.0**-20
    assert (results[0] - grid).abs().max() <= 2.0**-20
    assert results[0][-1] == truth[-1]  # an integer field (frac_bits 0) comes back exact


def test_a_scale_that_leaves_no_room_is_refused_like_an_overflow():
    assert scale_bits(SCHEMA, 10) == 40
    huge = Schema((Field("outer", (4,), 1e12),))
    with pytest.raises(CkksOverflowRisk, match="below 2\\^20"):
        scale_bits(huge, 30)


def test_the_aggregator_refuses_what_does_not_belong_to_its_sum():
    spec = SumSpec("r1", "contribution", SILOS, SCHEMA, b"", None)
    half = aggregator_half(spec)
    good = SECRET.encrypt(np.zeros(SCHEMA.size), scale_bits=30)
    with pytest.raises(WrongStage):
        half.receive("z", EncryptedUpload(good))  # not a silo of this sum
    with pytest.raises(WrongStage):
        half.receive("a", object())
    with pytest.raises(BadMessage, match="not a ciphertext"):
        half.receive("a", EncryptedUpload(b"garbage"))
    with pytest.raises(BadMessage, match="values; the schema has"):
        half.receive("a", EncryptedUpload(SECRET.encrypt(np.zeros(7), scale_bits=30)))
    half.receive("a", EncryptedUpload(good))
    half.receive("a", EncryptedUpload(good))  # an identical resend
    with pytest.raises(BadMessage, match="another ciphertext"):
        half.receive("a", EncryptedUpload(SECRET.encrypt(np.ones(SCHEMA.size), scale_bits=30)))
    assert half.upload_bytes("b", EncryptedUpload) == ciphertext_limit(SCHEMA.size) >= len(good)
    with pytest.raises(WrongStage):
        half.download("a")  # nothing summed yet
    steps = half.close()
    assert set(steps) == {"a"}
    assert half.download("a") == steps["a"].blob
    with pytest.raises(WrongStage):
        half.upload_bytes("b", EncryptedUpload)  # uploads have closed


def test_a_silo_signs_a_sum_only_over_its_silos_in_order_and_decrypts_only_what_it_may_release():
    spec = SumSpec("r1", "contribution", SILOS, SCHEMA, b"", None)
    blob = SECRET.encrypt(np.zeros(SCHEMA.size), scale_bits=30)
    asked = []

    def refuse(survivors):
        asked.append(survivors)
        raise BadMessage(f"not over {survivors}")

    halves = {u: silo_half(spec, u, refuse if u == "a" else lambda _: None) for u in ("a", "b")}
    signatures = {
        u: Signed(half.step(EncryptedSum(blob, ("a", "b")))[0].signature) for u, half in halves.items()
    }
    assert asked == []  # signing releases nothing: a sum's inputs are read where a silo decrypts it
    with pytest.raises(BadMessage, match="not over"):
        halves["a"].step(SumSignatures(signatures))
    assert asked == [("a", "b")]
    assert halves["a"].result is None
    halves["b"].step(SumSignatures(signatures))
    assert halves["b"].done
    for survivors in (("a", "z"), ("b", "a"), ("a", "a", "b")):
        with pytest.raises(BadMessage, match="outside this sum"):
            silo_half(spec, "a").step(EncryptedSum(blob, survivors))
    with pytest.raises(BadMessage, match="does not count a"):
        silo_half(spec, "a").step(EncryptedSum(blob, ("b", "c")))
    half = silo_half(spec, "a")
    with pytest.raises(WrongStage, match="no signed sum"):
        half.step(SumSignatures({}))  # signatures before the sum they sign
    half.step(EncryptedSum(blob, SILOS))
    with pytest.raises(WrongStage, match="already signed"):
        half.step(EncryptedSum(blob, SILOS))
    assert not half.done
    assert half.counted == ()


def expanded(values: np.ndarray, *, scale_bits: int = 30) -> bytes:
    """The same values in TenSEAL's own (expanded) form, in the layer's frame: both polynomials of each
    ciphertext written out, as uploads were before they became seeded."""
    context = ts.context_from(SECRET.secret_bytes())
    chunks = [
        ts.ckks_vector(context, values[i : i + SLOTS], scale=2.0**scale_bits)
        for i in range(0, len(values), SLOTS)
    ]
    return Ciphertext(chunks).serialize()


@given(st.integers(1, 3 * SLOTS))
@settings(max_examples=8, deadline=None)
def test_an_upload_in_the_expanded_form_is_refused_as_larger_than_needed(values):
    """A silo announcing twice the bytes its upload needs is refused before the aggregator reads a byte:
    the bound fits the seeded form the layer sends, not TenSEAL's expanded one."""
    schema = Schema((Field("delta", (values,), 50.0, frac_bits=20),))
    half = aggregator_half(SumSpec("r1", "contribution", SILOS, schema, b"", None))
    limit = half.upload_bytes("a", EncryptedUpload)
    assert len(SECRET.encrypt(np.zeros(values), scale_bits=30)) <= limit
    assert len(expanded(np.zeros(values))) > limit


def test_a_silos_upload_is_seeded_at_4_times_float32_and_the_sum_it_adds_up_to_is_expanded():
    """Each ciphertext's second polynomial travels as its seed: 4,096 values take one polynomial of 8,192
    64-bit coefficients. The aggregator reads the uploads with the public context alone; the sum it hands
    back is an ordinary ciphertext, twice the bytes."""
    values = np.random.default_rng(0).uniform(-50, 50, 3 * SLOTS)
    upload = SECRET.encrypt(values, scale_bits=30)
    assert len(upload) <= 4.1 * 4 * len(values)
    public = PublicContext.from_bytes(SECRET.public_bytes())
    total = public.add([upload, upload])
    assert len(total) > 1.95 * len(upload)
    assert np.abs(SECRET.decrypt(total, len(values)) - 2 * values).max() < 1e-5


def test_an_expanded_upload_handed_to_the_half_itself_is_refused():
    """The evaluation sum's uploads arrive inside state reports and reach the half without the Submit
    stream's announced-size check, so the half holds an upload to the seeded form's bound itself."""
    spec = SumSpec("r1", "evaluation", SILOS, SCHEMA, b"", None)
    half = aggregator_half(spec)
    with pytest.raises(BadMessage, match="seeded"):
        half.receive("a", EncryptedUpload(expanded(np.zeros(SCHEMA.size))))
    assert half.answered == set()
    half.receive("a", EncryptedUpload(SECRET.encrypt(np.zeros(SCHEMA.size), scale_bits=30)))
    assert half.answered == {"a"}


def test_the_seeded_sum_is_the_expanded_sum_within_ckks_error_on_the_grid():
    """The same three uploads, seeded and expanded: both sums decrypt to the truth within the grid, and to
    each other within one grid step (rounding may fall either side of a step for either)."""
    rng = np.random.default_rng(1)
    spec = SumSpec("r1", "contribution", SILOS, SCHEMA, b"", None)
    vectors = [np.append(rng.uniform(-50, 50, 5000), rng.integers(1, 1000)) for _ in SILOS]
    truth = sum(vectors)
    bits = scale_bits(SCHEMA, len(SILOS))
    sums = (
        SECRET.public.add([SECRET.encrypt(v, scale_bits=bits) for v in vectors]),
        SECRET.public.add([expanded(v, scale_bits=bits) for v in vectors]),
    )
    new, before = (on_grid(spec, SECRET.decrypt(s, SCHEMA.size)).numpy() for s in sums)
    assert np.abs(new - truth).max() <= 2.0**-20
    assert np.abs(before - truth).max() <= 2.0**-20
    assert np.abs(new - before).max() <= 2.0**-20
    assert new[-1] == before[-1] == truth[-1]


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
def test_seeded_ciphertexts_pass_through_memory_and_leave_no_descriptor_open():
    before = sorted(os.listdir("/proc/self/fd"))
    blob = SECRET.encrypt(np.arange(5.0), scale_bits=30)
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert np.allclose(SECRET.decrypt(blob, 5), np.arange(5.0), atol=1e-5)


def test_without_memfd_seeded_ciphertexts_pass_through_a_private_directory_removed_after(
    monkeypatch, tmp_path
):
    """Where SEAL can reach no in-memory file, each ciphertext is written in a 0700 directory, then read."""
    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    modes = []
    read = seeded._PrivateFile.read

    def spy(target):
        modes.append(stat.S_IMODE(os.stat(os.path.dirname(target.path)).st_mode))
        return read(target)

    monkeypatch.setattr(seeded._PrivateFile, "read", spy)
    values = np.random.default_rng(2).uniform(-1, 1, SLOTS + 7)
    blob = SECRET.encrypt(values, scale_bits=30)
    assert modes == [0o700, 0o700]
    assert list(tmp_path.iterdir()) == []
    assert len(blob) <= ciphertext_limit(len(values))
    assert np.abs(SECRET.decrypt(blob, len(values)) - values).max() < 1e-5
