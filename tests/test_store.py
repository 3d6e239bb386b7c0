import sqlite3
import threading

import pytest

from aggregator.store import AuditKey, Retention, Store, StoreError

AUDIT_KEY = AuditKey(b"fedlt tests' fixed audit key ...")


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    yield s
    s.close()


def test_binding_refuses_another_consortium(tmp_path):
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    assert s.bind("a") is True
    assert s.bind("a") is False
    with pytest.raises(StoreError, match="other settings"):
        s.bind("b")
    s.close()


def test_rounds_commit_in_order_and_survive_reopening(tmp_path):
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    s.save_initial_state("d0", b"state0")
    attempt, round_id = s.begin_attempt(1, ["silo-0", "silo-1"], "n1")
    assert attempt == 1
    s.commit_round(round_number=1, round_id=round_id, digest="d1", data=b"state1", contributors=["silo-0"])
    assert s.metrics_history() == []
    s.save_metrics(1, {"round": 1, "accuracy": 0.5})
    with pytest.raises(StoreError, match="cannot commit round 3 on top of round 1"):
        s.commit_round(round_number=3, round_id="x", digest="d3", data=b"", contributors=[])
    s.close()
    again = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    latest = again.latest_state()
    assert (latest.round, latest.digest, latest.data) == (1, "d1", b"state1")
    assert again.metrics_history() == [{"round": 1, "accuracy": 0.5}]
    again.close()


def test_metrics_of_a_database_from_before_their_table_are_kept(tmp_path):
    """Metrics used to live in the states' rows; a database of that layout opens with its history whole, and
    saving a round's metrics no longer touches the state's row."""
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    s.save_initial_state("d0", b"state0")
    s.close()
    db = sqlite3.connect(tmp_path / "db.sqlite")
    db.execute("ALTER TABLE states ADD COLUMN metrics TEXT")  # the old layout: a column of the state's row
    db.execute("""UPDATE states SET metrics = '{"round": 0, "accuracy": 0.1}' WHERE round = 0""")
    db.commit()
    db.close()
    again = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    _, round_id = again.begin_attempt(1, ["silo-0"], "n1")
    again.commit_round(
        round_number=1, round_id=round_id, digest="d1", data=b"state1", contributors=["silo-0"]
    )
    again.save_metrics(1, {"round": 1, "accuracy": 0.5})
    assert again.metrics_history() == [{"round": 0, "accuracy": 0.1}, {"round": 1, "accuracy": 0.5}]
    again.close()


def test_open_attempts_are_abandoned_and_the_round_gets_a_new_attempt(store):
    store.save_initial_state("d0", b"")
    _, first = store.begin_attempt(1, ["a"], "n1")
    assert store.abandon_open_attempts("restart") == [first]
    attempt, second = store.begin_attempt(1, ["a"], "n2")
    assert attempt == 2
    assert second != first
    events = [r.event for r in store.audit_log()]
    assert events == ["initial_state", "attempt_started", "attempt_abandoned", "attempt_started"]
    assert store.attempt_statuses() == ["abandoned", "open"]


def test_a_reader_on_another_thread_never_breaks_the_drivers_checkpoint(store):
    """The round driver checkpoints the connection that status readers share: readers go through the store's
    lock (a statement running on the shared connection makes the checkpoint fail with 'table is locked')."""
    store.save_initial_state("d0", b"")
    for k in range(200):
        store.begin_attempt(1, ["a"], f"n{k}")
    done, seen = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            seen.append(len(store.attempt_statuses()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(300):
            store.checkpoint()
    finally:
        done.set()
        reader.join()
    assert seen
    assert set(seen) == {200}


def test_the_first_survivor_set_a_round_asked_silos_to_release_is_kept_across_reopening(tmp_path):
    """Silos release a round's sum for one set only (silo.releases): the set kept is the one asked first."""
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    s.pin_release(1, "contribution", ["silo-2", "silo-0", "silo-1"])
    s.pin_release(1, "contribution", ["silo-0", "silo-1", "silo-2", "silo-3"])
    s.pin_release(1, "census", ["silo-0", "silo-1", "silo-2", "silo-3"])
    s.close()
    again = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    assert again.pinned_releases(1) == {
        "contribution": ["silo-0", "silo-1", "silo-2"],
        "census": ["silo-0", "silo-1", "silo-2", "silo-3"],
    }
    assert again.pinned_releases(2) == {}
    again.close()


def test_audit_log_is_append_only(store):
    store.audit("test", {"k": 1})
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._db.execute("UPDATE audit SET event = 'x'")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._db.execute("DELETE FROM audit")


def test_audit_chain_detects_edits_behind_sqlites_back(store):
    for i in range(3):
        store.audit("event", {"i": i})
    store.verify_audit()
    store._db.execute("DROP TRIGGER audit_no_update")
    store._db.execute("UPDATE audit SET detail = '{\"i\": 7}' WHERE seq = 2")
    with pytest.raises(StoreError, match="audit record 2"):
        store.verify_audit()


def test_registration_is_audited_once_per_certificate(store):
    store.register_silo("silo-0", "c1", "v", {})
    store.register_silo("silo-0", "c1", "v", {})
    store.register_silo("silo-0", "c2", "v", {})
    assert [r.event for r in store.audit_log()] == ["silo_enrolled", "silo_certificate_changed"]
    assert list(store.silos()) == ["silo-0"]


def test_old_states_are_pruned_but_latest_kept(store):
    store.save_initial_state("d0", b"s0")
    for r in range(1, 6):
        _, rid = store.begin_attempt(r, ["a"], f"n{r}")
        store.commit_round(
            round_number=r,
            round_id=rid,
            digest=f"d{r}",
            data=f"s{r}".encode(),
            contributors=["a"],
        )
    sizes = dict(store._db.execute("SELECT round, length(data) FROM states"))
    assert sizes == {0: 0, 1: 0, 2: 0, 3: 2, 4: 2, 5: 2}
    assert store.latest_state().data == b"s5"


def _kept(store: Store) -> list[int]:
    rows = store._db.execute("SELECT round FROM states WHERE length(data) > 0 ORDER BY round")
    return [r for (r,) in rows]


def _commit_rounds(store: Store, first: int, last: int) -> None:
    for r in range(first, last + 1):
        _, round_id = store.begin_attempt(r, ["a"], f"n{r}")
        store.commit_round(round_number=r, round_id=round_id, digest=f"d{r}", data=b"w", contributors=["a"])


@pytest.mark.parametrize(
    ("retention", "kept"),
    [
        (Retention(), [10, 11, 12]),
        (Retention(last=1), [12]),
        (Retention(last=2, every=5), [0, 5, 10, 11, 12]),
    ],
)
def test_retention_keeps_the_last_k_states_and_every_mth(tmp_path, retention, kept):
    """Guards the soak's file growth: older states lose their weights, never their record."""
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY, retention=retention)
    store.save_initial_state("d0", b"w")
    _commit_rounds(store, 1, 12)
    assert _kept(store) == kept
    rounds = store._db.execute("SELECT round, digest FROM states ORDER BY round").fetchall()
    assert rounds == [(r, f"d{r}") for r in range(13)]
    assert len([r for r in store.audit_log() if r.event == "round_committed"]) == 12
    store.close()


def test_a_shorter_retention_after_a_restart_blanks_what_it_no_longer_keeps(tmp_path):
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY, retention=Retention(last=6))
    store.save_initial_state("d0", b"w")
    _commit_rounds(store, 1, 8)
    store.close()
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY, retention=Retention(last=2))
    _commit_rounds(store, 9, 9)
    assert _kept(store) == [8, 9]
    store.close()


def test_a_committed_state_waits_in_the_log_until_the_checkpoint(tmp_path):
    """SQLite would copy a multi-megabyte state into the file inside the commit; the round driver checkpoints
    later, and a crash before then loses nothing: the reopened store reads the state from the log."""
    path = tmp_path / "db.sqlite"
    s = Store(path, audit_key=AUDIT_KEY)
    s.save_initial_state("d0", b"")
    _, round_id = s.begin_attempt(1, ["silo-0"], "n1")
    state = bytes(range(256)) * (8 * 1024 * 6)  # 12 MB, three times SQLite's default threshold
    s.commit_round(round_number=1, round_id=round_id, digest="d1", data=state, contributors=["silo-0"])
    wal = path.with_name(path.name + "-wal")
    assert wal.stat().st_size > len(state)  # still in the log: no checkpoint ran in the commit
    assert path.stat().st_size < len(state)
    reopened = sqlite3.connect(path)  # another process, as after a crash
    assert reopened.execute("SELECT data FROM states WHERE round = 1").fetchone()[0] == state
    reopened.close()
    s.checkpoint()
    assert path.stat().st_size > len(state)
    s.close()
