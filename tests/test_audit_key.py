"""The audit chain is keyed: whoever holds a copy of the database alone can no longer rewrite its history.

The attack mounted here is the one an unkeyed SHA-256 chain cannot stop: drop the append-only triggers from
a second connection, edit a record, recompute every hash after it, and hand the file back.
"""

from __future__ import annotations

import hashlib
import hmac
import sqlite3

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from aggregator.server import derive_audit_key
from aggregator.store import GENESIS, AuditKey, Store, StoreError

KEY = AuditKey(b"fedlt test audit key, 32 bytes!!")
ROWS = "SELECT seq, at_ms, event, detail FROM audit ORDER BY seq"


def _history(path) -> Store:
    store = Store(path, audit_key=KEY)
    store.register_silo("silo-0", "c0", "fedlt-silo/0.1", {})
    store.audit("picked", {"silos": ["silo-0"]})
    store.register_silo("silo-1", "c1", "fedlt-silo/0.1", {})
    store.verify_audit()
    return store


def _sha256_chain(prev: str, at_ms: int, event: str, detail: str) -> str:
    return hashlib.sha256(f"{prev}\x1f{at_ms}\x1f{event}\x1f{detail}".encode()).hexdigest()


def test_an_edited_record_with_the_unkeyed_chain_recomputed_is_refused(tmp_path):
    store = _history(tmp_path / "db.sqlite")
    forger = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
    forger.execute("DROP TRIGGER audit_no_update")
    forger.execute("""UPDATE audit SET detail = '{"silos": ["silo-1"]}' WHERE event = 'picked'""")
    prev = GENESIS
    for seq, at_ms, event, detail in forger.execute(ROWS):
        digest = _sha256_chain(prev, at_ms, event, detail)
        forger.execute("UPDATE audit SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, digest, seq))
        prev = digest
    forger.close()
    with pytest.raises(StoreError, match=r"audit record 1 \(silo_enrolled\) does not match the hash chain"):
        store.verify_audit()
    store.close()


def test_a_chain_recomputed_under_another_key_is_refused(tmp_path):
    """The forger guesses a key; the store, holding the real one, is not fooled."""
    store = _history(tmp_path / "db.sqlite")
    guess = b"the forger's guess at the key..."
    forger = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
    forger.execute("DROP TRIGGER audit_no_update")
    prev = GENESIS
    for seq, at_ms, event, detail in forger.execute(ROWS):
        message = f"{prev}\x1f{at_ms}\x1f{event}\x1f{detail}".encode()
        digest = hmac.new(guess, message, hashlib.sha256).hexdigest()
        forger.execute("UPDATE audit SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, digest, seq))
        prev = digest
    forger.close()
    with pytest.raises(StoreError, match="audit record 1"):
        store.verify_audit()
    store.close()


def test_a_database_chained_under_another_key_is_refused_on_opening(tmp_path):
    _history(tmp_path / "db.sqlite").close()
    with pytest.raises(StoreError, match="another key"):
        Store(tmp_path / "db.sqlite", audit_key=AuditKey(b"another aggregator's audit key!!"))
    again = Store(tmp_path / "db.sqlite", audit_key=KEY)
    again.verify_audit()
    again.close()


def test_a_database_from_before_keyed_chains_is_refused_not_trusted(tmp_path):
    """An unkeyed chain proves nothing against a forger, so the aggregator neither verifies nor extends it."""
    path = tmp_path / "db.sqlite"
    _history(path).close()
    legacy = sqlite3.connect(path, isolation_level=None)
    legacy.execute("DELETE FROM meta WHERE key = 'audit_key'")
    legacy.close()
    with pytest.raises(StoreError, match="chained without a key"):
        Store(path, audit_key=KEY)


def test_an_audit_key_is_long_enough_and_stays_out_of_logs():
    with pytest.raises(ValueError, match="32 bytes"):
        AuditKey(b"short")
    assert "fedlt test" not in repr(KEY)


def test_the_audit_key_is_hkdf_sha256_of_the_aggregators_private_scalar():
    """Oracle: RFC 5869 HKDF written out with hmac (no salt: a zero key; one block of output)."""
    scalar = 0x1F2E3D4C5B6A79880123456789ABCDEF0123456789ABCDEF0123456789ABCDEF
    private_key = ec.derive_private_key(scalar, ec.SECP256R1())
    prk = hmac.new(bytes(32), scalar.to_bytes(32, "big"), hashlib.sha256).digest()
    okm = hmac.new(prk, b"fedlt/audit-chain/v1\x01", hashlib.sha256).digest()
    assert derive_audit_key(private_key) == AuditKey(okm)
    other = derive_audit_key(ec.derive_private_key(scalar + 1, ec.SECP256R1()))
    assert other != AuditKey(okm)
