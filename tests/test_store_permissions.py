"""The database holds silo disclosures: only the aggregator's own user may read it, whatever the umask."""

from __future__ import annotations

import os
import stat

import pytest

from aggregator.store import AuditKey, Store


@pytest.fixture
def permissive_umask():
    """The common default, under which SQLite would create a world-readable file."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("permissive_umask")
def test_a_new_data_directory_and_database_are_private(tmp_path):
    path = tmp_path / "aggregator-data" / "consortium.sqlite"
    store = Store(path, audit_key=AuditKey(bytes(32)))
    try:
        store.audit("test", {"k": 1})  # a write, so the write-ahead log exists
        assert _mode(path.parent) == 0o700
        for name in ("consortium.sqlite", "consortium.sqlite-wal", "consortium.sqlite-shm"):
            assert _mode(path.parent / name) == 0o600, name
    finally:
        store.close()
