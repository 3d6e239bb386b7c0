"""The key service's ceremony (`privacy.keyservice.ceremony`), moving a CKKS key, probed as a hostile
aggregator or silo would probe it.

The aggregator relays every enrollment key and every sealed envelope, so it can drop, swap, relabel, replay
and tamper with each; a roster silo can seal a key of its own or sign for another. Each attack is first shown
to work where the check it meets is absent (the key holder seals without checking, a silo takes any sender,
the signature check is switched off), then the check is shown to stop it with `CeremonyError`. Tampering meets
two checks, the key holder's signature and ChaCha20-Poly1305, and each is shown to stop it alone. The key
schedule is checked against RFC 7748's X25519 vectors and an HKDF written out from RFC 5869.

The consortium (CA, four silos, roster) is tests/test_roster.py's.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.ckks.keys import SecretContext
from privacy.keyservice import ceremony
from privacy.keyservice.ceremony import (
    ANNOUNCE_CONTEXT,
    SEAL_CONTEXT,
    SEAL_INFO,
    Announcement,
    CeremonyError,
    SealedContext,
    _key,
    announce,
    check_announcement,
    open_sealed,
    seal,
)
from privacy.pki.ca import issue_silo, revoke
from privacy.pki.identity import MemberTrust, read_certificate, revoked_serials
from privacy.pki.roster import Roster
from privacy.pki.signing import sign, verify
from tests.test_roster import SILOS, key, pem, trust
from tests.test_roster import consortium as consortium  # the module-scoped fixture: CA, 4 silos, roster

CONSORTIUM = "health"  # the roster's consortium id
HOLDER, ME, OTHER, REVOKED = "st-marys", "city-clinic", "north-bank", "harbour"
assert {HOLDER, ME, OTHER, REVOKED} == set(SILOS)

# RFC 7748 section 6.1: Alice's and Bob's X25519 keys and their shared secret
ALICE_PRIVATE = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
ALICE_PUBLIC = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
BOB_PRIVATE = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
BOB_PUBLIC = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
SHARED = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
# _key(SHARED, "health", "ckks", "st-marys", "city-clinic", "00" * 32), as `rfc5869_key` computes it
PINNED_KEY = "3fb2cf91f2a87d341f42cad710ea69825f2fddb2208671b8b0f7464e6bfade65"
LAYER = "ckks"  # the layer whose key the envelopes seal

# the byte strings of an envelope, and its names
BYTE_FIELDS = ("ephemeral", "ciphertext", "signature")
NAME_FIELDS = ("sender", "recipient", "context_id")


def signer(root: Path, silo: str):
    """The `sign` callable a silo's agent passes to the ceremony: its certificate key, a purpose a message."""
    private = key(root, silo)
    return lambda data, *, context: sign(private, data, context=context)


def enrolled(
    root: Path, silo: str, enrollment: X25519PrivateKey, consortium_id: str = CONSORTIUM
) -> Announcement:
    """`silo`'s announcement as the aggregator relays it, with the certificate it registered with."""
    announcement = announce(consortium_id, silo, enrollment, signer(root, silo))
    return replace(announcement, certificate=pem(root, silo))


def signed_public(root: Path, silo: str, public: bytes) -> Announcement:
    """`silo` signing any bytes as its enrollment key, which `announce` (taking a key pair) cannot do."""
    message = Announcement(silo, public, b"").message(CONSORTIUM)
    return Announcement(silo, public, signer(root, silo)(message, context=ANNOUNCE_CONTEXT), pem(root, silo))


def flip(sealed: SealedContext, name: str, index: int = 0, mask: int = 1) -> SealedContext:
    """`sealed` with byte `index` of field `name` XORed with `mask` (text stays ASCII for masks below 128)."""
    value = getattr(sealed, name)
    raw = bytearray(value.encode() if isinstance(value, str) else value)
    raw[index % len(raw)] ^= mask
    return replace(sealed, **{name: raw.decode("latin-1") if isinstance(value, str) else bytes(raw)})


def rfc5869_key(shared: bytes, *parts: str) -> bytes:
    """The sealing key written out: HKDF-SHA256 (RFC 5869, no salt) over the length-prefixed names."""
    info = SEAL_INFO + b"".join(struct.pack(">I", len(p.encode())) + p.encode() for p in parts)
    prk = hmac.new(bytes(32), shared, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


@pytest.fixture
def no_signature_check(monkeypatch):
    """What would still stop an attack if the key holder's signature were not checked (or were forged)."""
    monkeypatch.setattr(ceremony, "verify", lambda *args, **kwargs: None)


@dataclass(frozen=True)
class Ceremony:
    """One run of the ceremony: HOLDER's key sealed to ME and OTHER, and what the aggregator relayed."""

    root: Path
    roster: Roster
    members: MemberTrust
    secret: SecretContext
    enrollment: dict[str, X25519PrivateKey]
    announced: dict[str, Announcement]
    sealed: dict[str, SealedContext]

    def seal(
        self,
        recipient: Announcement,
        *,
        secret: SecretContext | None = None,
        sender: str = HOLDER,
        signed_by: str = "",
        consortium_id: str = CONSORTIUM,
        layer: str = LAYER,
    ) -> SealedContext:
        """`secret` (the consortium's by default) sealed by `sender`, signed with `signed_by`'s key."""
        return seal(
            secret or self.secret,
            consortium=consortium_id,
            layer=layer,
            sender=sender,
            recipient=recipient,
            sign=signer(self.root, signed_by or sender),
        )

    def open(
        self,
        sealed: SealedContext,
        *,
        me: str = ME,
        holder: str = HOLDER,
        enrollment: X25519PrivateKey | None = None,
        holder_certificate: bytes = b"",
        consortium_id: str = CONSORTIUM,
        layer: str = LAYER,
    ) -> SecretContext:
        """`sealed` opened by `me` (with its own enrollment key unless told) for the RoundSpec's `holder`."""
        return open_sealed(
            sealed,
            consortium=consortium_id,
            layer=layer,
            me=me,
            enrollment=enrollment or self.enrollment[me],
            holder=holder,
            holder_certificate=holder_certificate or pem(self.root, holder),
            members=self.members,
            read=SecretContext.from_secret_bytes,
        )


@pytest.fixture(scope="module")
def run(consortium) -> Ceremony:
    root, roster = consortium
    members = trust(root, roster)
    enrollment = {silo: X25519PrivateKey.generate() for silo in (ME, OTHER)}
    announced = {silo: enrolled(root, silo, k) for silo, k in enrollment.items()}
    secret = SecretContext.new()
    partial = Ceremony(root, roster, members, secret, enrollment, announced, {})
    for announcement in announced.values():
        check_announcement(announcement, CONSORTIUM, members)
    sealed = {silo: partial.seal(a) for silo, a in announced.items()}
    return replace(partial, sealed=sealed)


# --- the ceremony as it should go ---------------------------------------------------------------------------


def test_a_sealed_context_opens_at_its_recipient_as_the_holders_key(run):
    """announce, check_announcement, seal, open_sealed: the same key, so each reads what the other wrote."""
    mine = run.open(run.sealed[ME])
    assert mine.context_id == run.secret.context_id
    values = np.array([1.5, -2.25, 0.0, 1000.0])
    from_holder = run.secret.encrypt(values, scale_bits=30)
    assert np.allclose(mine.decrypt(from_holder, 4), values, atol=1e-5)
    # the aggregator's part: add the two ciphertexts
    total = run.secret.public.add([from_holder, mine.encrypt(values, scale_bits=30)])
    assert np.allclose(run.secret.decrypt(total, 4), 2 * values, atol=1e-5)
    assert run.open(run.sealed[OTHER], me=OTHER).context_id == run.secret.context_id


def test_every_envelope_has_its_own_ephemeral_key_even_to_the_same_silo(run):
    again = run.seal(run.announced[ME])
    envelopes = [run.sealed[ME], run.sealed[OTHER], again]
    assert len({e.ephemeral for e in envelopes}) == 3  # the all-zero nonce is safe only under a fresh key
    assert len({e.ciphertext for e in envelopes}) == 3
    assert run.open(again).context_id == run.secret.context_id


# --- enrollment keys: the key holder seals only to a key a roster silo signed -------------------------------


def test_an_enrollment_key_the_aggregator_swaps_in_would_hand_it_the_key_and_is_refused(run):
    """The relay puts its own X25519 key in ME's announcement, keeping ME's signature and certificate."""
    aggregators = X25519PrivateKey.generate()
    swapped = replace(run.announced[ME], public=aggregators.public_key().public_bytes_raw())
    # the attack, had the key holder sealed to it unchecked
    stolen = run.open(run.seal(swapped), enrollment=aggregators)
    assert stolen.context_id == run.secret.context_id
    with pytest.raises(CeremonyError, match="signature does not verify"):
        check_announcement(swapped, CONSORTIUM, run.members)


def test_an_enrollment_key_of_a_ca_issued_sybil_is_refused(run, tmp_path):
    """The operator holds the CA key: it issues a certificate for a silo the roster does not name."""
    issue_silo(run.root / "ca", tmp_path / "kits", silo_id="sybil")
    sybil = enrolled(tmp_path, "sybil", X25519PrivateKey.generate())
    # the attack: the signature verifies under a certificate the consortium CA issued
    certificate = read_certificate(tmp_path / "kits" / "sybil.pem")
    verify(certificate, sybil.signature, sybil.message(CONSORTIUM), context=ANNOUNCE_CONTEXT)
    with pytest.raises(CeremonyError, match="does not name this certificate"):
        check_announcement(sybil, CONSORTIUM, run.members)


def test_an_enrollment_key_under_a_revoked_certificate_is_refused(run):
    announcement = enrolled(run.root, REVOKED, X25519PrivateKey.generate())
    check_announcement(announcement, CONSORTIUM, run.members)  # the attack, where the CRL is not heeded
    serial = revoke(run.root / "ca", silo_id=REVOKED)
    crl = revoked_serials(
        (run.root / "ca" / "crl.pem").read_bytes(), read_certificate(run.root / "ca" / "ca.pem"), source="crl"
    )
    assert serial in crl
    with pytest.raises(CeremonyError, match="revoked"):
        check_announcement(announcement, CONSORTIUM, trust(run.root, run.roster, crl))


def test_an_enrollment_key_signed_for_another_consortium_is_refused(run):
    elsewhere = enrolled(run.root, ME, run.enrollment[ME], consortium_id="another-consortium")
    check_announcement(elsewhere, "another-consortium", run.members)  # genuine where it was signed
    with pytest.raises(CeremonyError, match="signature does not verify"):
        check_announcement(elsewhere, CONSORTIUM, run.members)


def test_an_enrollment_key_relabelled_to_another_silo_is_refused(run):
    """ME's genuine announcement passed off as OTHER's: envelopes for OTHER would go to ME's key."""
    genuine = run.announced[ME]
    check_announcement(genuine, CONSORTIUM, run.members)
    with pytest.raises(CeremonyError, match=f"belongs to {ME}|does not name"):  # ME's certificate, OTHER's id
        check_announcement(replace(genuine, silo=OTHER), CONSORTIUM, run.members)
    with pytest.raises(CeremonyError, match="signature does not verify"):  # OTHER's certificate too
        check_announcement(
            replace(genuine, silo=OTHER, certificate=pem(run.root, OTHER)), CONSORTIUM, run.members
        )
    # a roster silo signing for another: OTHER announces a key of its own under ME's name
    impostor = replace(
        announce(CONSORTIUM, ME, X25519PrivateKey.generate(), signer(run.root, OTHER)),
        certificate=pem(run.root, OTHER),
    )
    with pytest.raises(CeremonyError, match=f"belongs to {OTHER}|does not name"):
        check_announcement(impostor, CONSORTIUM, run.members)


@pytest.mark.parametrize("length", [0, 31, 33])
def test_an_enrollment_key_of_the_wrong_length_is_refused(run, length):
    announcement = signed_public(run.root, ME, bytes(range(length)))
    with pytest.raises(CeremonyError, match=f"{length} bytes"):
        check_announcement(announcement, CONSORTIUM, run.members)


@pytest.mark.parametrize(
    "low_order",
    [
        bytes(32),
        (1).to_bytes(32, "little"),
        bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    ],
    ids=["zero", "one", "order-8"],
)
def test_a_low_order_enrollment_key_is_refused_when_announced_not_a_crash_when_sealed(run, low_order):
    """A roster silo (malicious or broken) announces a small-order point: X25519 with it is all zeros."""
    announcement = signed_public(run.root, ME, low_order)
    with pytest.raises(ValueError, match="shared key"):  # the attack: not a CeremonyError, so share() stops
        run.seal(announcement)
    with pytest.raises(CeremonyError):
        check_announcement(announcement, CONSORTIUM, run.members)


# --- sealed envelopes: a silo opens only its own, from the named key holder, untouched ----------------------


def test_an_envelope_addressed_to_another_silo_is_refused_when_replayed_or_relabelled(
    run, no_signature_check
):
    theirs = run.sealed[OTHER]
    assert run.open(theirs, me=OTHER).context_id == run.secret.context_id  # genuine, for OTHER
    with pytest.raises(CeremonyError, match=f"expected {HOLDER} to {ME}"):
        run.open(theirs)
    # relabelled to ME: with the signature check off, the key (bound to OTHER's enrollment key and id) fails
    with pytest.raises(CeremonyError, match="does not open"):
        run.open(replace(theirs, recipient=ME))


def test_a_relabelled_envelope_fails_the_key_holders_signature(run):
    with pytest.raises(CeremonyError, match="signature"):
        run.open(replace(run.sealed[OTHER], recipient=ME))


def test_a_key_sealed_by_a_silo_the_roundspec_does_not_name_is_refused(run):
    """OTHER, a roster silo, seals a key of its own to ME: ME would encrypt under a key OTHER can share."""
    rogue = SecretContext.new()
    from_other = run.seal(run.announced[ME], secret=rogue, sender=OTHER)
    assert run.open(from_other, holder=OTHER).context_id == rogue.context_id  # the attack, taking any sender
    with pytest.raises(CeremonyError, match=f"from {OTHER} to {ME}; expected {HOLDER} to {ME}"):
        run.open(from_other)
    # OTHER names the holder as sender but signs with its own key; under the holder's or its own certificate
    posing = run.seal(run.announced[ME], secret=rogue, sender=HOLDER, signed_by=OTHER)
    with pytest.raises(CeremonyError, match="signature does not verify"):
        run.open(posing)
    with pytest.raises(CeremonyError, match=f"belongs to {OTHER}|does not name"):
        run.open(posing, holder_certificate=pem(run.root, OTHER))


def test_a_key_holders_signature_made_for_another_purpose_is_refused(run):
    """The holder's key signed the very envelope bytes, but as an enrollment announcement."""
    sealed = run.sealed[ME]
    cross = replace(
        sealed,
        signature=signer(run.root, HOLDER)(sealed.message(CONSORTIUM, LAYER), context=ANNOUNCE_CONTEXT),
    )
    with pytest.raises(CeremonyError, match=f"not signed for '{SEAL_CONTEXT}'"):
        run.open(cross)


@pytest.mark.parametrize("name", ["ciphertext", "ephemeral", "context_id"])
def test_a_tampered_envelope_fails_the_signature_and_without_it_the_aead(run, name, monkeypatch):
    tampered = flip(run.sealed[ME], name)
    with pytest.raises(CeremonyError, match="signature does not verify"):
        run.open(tampered)
    monkeypatch.setattr(ceremony, "verify", lambda *args, **kwargs: None)
    assert run.open(run.sealed[ME]).context_id == run.secret.context_id  # only the signature check is off
    with pytest.raises(CeremonyError, match="does not open"):
        run.open(tampered)


def test_the_ignored_top_bit_of_the_ephemeral_key_is_still_bound(run, no_signature_check):
    """X25519 ignores bit 255 of a public key (RFC 7748), so flipping it leaves the shared secret as it was;
    the AEAD's associated data names the ephemeral key's bytes, so the envelope still does not open."""
    sealed = run.sealed[ME]
    flipped = flip(sealed, "ephemeral", index=31, mask=0x80)
    mine = run.enrollment[ME]
    assert mine.exchange(X25519PublicKey.from_public_bytes(flipped.ephemeral)) == mine.exchange(
        X25519PublicKey.from_public_bytes(sealed.ephemeral)
    )
    with pytest.raises(CeremonyError, match="does not open"):
        run.open(flipped)


def test_an_envelope_for_one_consortium_does_not_open_in_another(run, no_signature_check):
    """Bound twice: the signature covers the consortium id, and so do the key schedule and the AEAD (shown
    here with the signature check off)."""
    with pytest.raises(CeremonyError, match="does not open"):
        run.open(run.sealed[ME], consortium_id="another-consortium")
    elsewhere = run.seal(run.announced[ME], consortium_id="another-consortium")
    assert run.open(elsewhere, consortium_id="another-consortium").context_id == run.secret.context_id
    with pytest.raises(CeremonyError, match="does not open"):
        run.open(elsewhere)


def test_an_envelope_for_another_consortium_fails_the_signature(run):
    elsewhere = run.seal(run.announced[ME], consortium_id="another-consortium")
    with pytest.raises(CeremonyError, match="signature does not verify"):
        run.open(elsewhere)


def test_an_envelope_that_holds_another_key_than_it_names_is_refused(run):
    """The key holder (or a bug in it) names one key and seals another: a silo would file a key under the id
    a RoundSpec names and encrypt under something else."""
    named = SecretContext.new()
    mislabelled = SimpleNamespace(context_id=named.context_id, secret_bytes=run.secret.secret_bytes)
    sealed = run.seal(run.announced[ME], secret=mislabelled)
    assert sealed.context_id == named.context_id  # signed, addressed, and it decrypts
    with pytest.raises(CeremonyError, match="holds another key than it names"):
        run.open(sealed)


def test_the_aggregator_cannot_open_what_it_relays(run, no_signature_check):
    """It holds every envelope, every announcement, the public context and the holder's certificate, but no
    enrollment private key: its own X25519 key opens nothing, whoever it claims to be, even were the
    signatures not checked."""
    aggregators = X25519PrivateKey.generate()
    for silo, sealed in run.sealed.items():
        with pytest.raises(CeremonyError, match="does not open"):
            run.open(sealed, me=silo, enrollment=aggregators)


# --- every single-byte change is refused --------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(BYTE_FIELDS), where=st.integers(min_value=0), mask=st.integers(1, 255))
def test_flipping_any_byte_of_an_envelope_is_refused(run, name, where, mask):
    with pytest.raises(CeremonyError):
        run.open(flip(run.sealed[ME], name, where, mask))


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(("ephemeral", "ciphertext")),
    where=st.integers(min_value=0),
    mask=st.integers(1, 255),
)
def test_flipping_any_byte_is_refused_by_the_aead_alone(run, name, where, mask):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ceremony, "verify", lambda *args, **kwargs: None)
        with pytest.raises(CeremonyError, match="does not open"):
            run.open(flip(run.sealed[ME], name, where, mask))


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(NAME_FIELDS), where=st.integers(min_value=0))
def test_changing_any_name_of_an_envelope_is_refused(run, name, where):
    with pytest.raises(CeremonyError):
        run.open(flip(run.sealed[ME], name, where))


# --- the key schedule, against published vectors ------------------------------------------------------------


def test_x25519_matches_rfc_7748_and_both_ends_derive_the_same_sealing_key():
    alice = X25519PrivateKey.from_private_bytes(ALICE_PRIVATE)  # the key holder's ephemeral key
    bob = X25519PrivateKey.from_private_bytes(BOB_PRIVATE)  # the recipient's enrollment key
    assert alice.public_key().public_bytes_raw() == ALICE_PUBLIC
    assert bob.public_key().public_bytes_raw() == BOB_PUBLIC
    sender_side = alice.exchange(X25519PublicKey.from_public_bytes(BOB_PUBLIC))
    recipient_side = bob.exchange(X25519PublicKey.from_public_bytes(ALICE_PUBLIC))
    assert sender_side == recipient_side == SHARED
    names = (CONSORTIUM, LAYER, HOLDER, ME, "00" * 32)
    assert _key(sender_side, *names) == _key(recipient_side, *names) == rfc5869_key(SHARED, *names)
    assert _key(SHARED, *names).hex() == PINNED_KEY


BOUND = (SHARED, CONSORTIUM, LAYER, HOLDER, ME, "00" * 32)


@pytest.mark.parametrize(
    "changed",
    [
        (SHARED[:-1] + b"\x00", *BOUND[1:]),
        (SHARED, "another-consortium", LAYER, HOLDER, ME, "00" * 32),
        (SHARED, CONSORTIUM, "blind", HOLDER, ME, "00" * 32),
        (SHARED, CONSORTIUM, LAYER, OTHER, ME, "00" * 32),
        (SHARED, CONSORTIUM, LAYER, HOLDER, OTHER, "00" * 32),
        (SHARED, CONSORTIUM, LAYER, HOLDER, ME, "01" * 32),
        (SHARED, CONSORTIUM, LAYER, ME, HOLDER, "00" * 32),
        (SHARED, CONSORTIUM, LAYER + HOLDER[:1], HOLDER[1:], ME, "00" * 32),
    ],
    ids=["shared", "consortium", "layer", "sender", "recipient", "context-id", "swapped", "boundary-moved"],
)
def test_the_sealing_key_binds_consortium_layer_sender_recipient_and_context_id(changed):
    """Each name changes the key; so does moving a boundary between two (the names are length-prefixed)."""
    assert _key(*changed) != _key(*BOUND)


def test_a_sealed_context_is_the_secret_under_the_written_out_key_schedule(run, monkeypatch):
    """Seal with RFC 7748's Alice as the ephemeral key to Bob as ME's enrollment key; decrypt by hand."""
    monkeypatch.setattr(
        ceremony,
        "X25519PrivateKey",
        SimpleNamespace(generate=lambda: X25519PrivateKey.from_private_bytes(ALICE_PRIVATE)),
    )
    bob = X25519PrivateKey.from_private_bytes(BOB_PRIVATE)
    sealed = run.seal(enrolled(run.root, ME, bob))
    assert sealed.ephemeral == ALICE_PUBLIC
    names = (CONSORTIUM, LAYER, HOLDER, ME, run.secret.context_id)
    aad = b"".join(struct.pack(">I", len(p)) + p for p in (*(n.encode() for n in names), ALICE_PUBLIC))
    plain = ChaCha20Poly1305(rfc5869_key(SHARED, *names)).decrypt(bytes(12), sealed.ciphertext, aad)
    assert plain == run.secret.secret_bytes()
    assert run.open(sealed, enrollment=bob).context_id == run.secret.context_id
