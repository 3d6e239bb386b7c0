"""Two agents on one state directory, or two writers of one ledger, lose nothing (issue 31, item 1).

The finding: two studies ran at once, each silo's two agents sharing the silo's one state directory. Each
agent kept its own copy of the ledgers and the last writer won: a silo's privacy ledger held 7 of its 10
entries and `releases.json` 9 of 12 rounds, so neither the DP budget nor one release per state held any more.
The attacks are mounted here on the ledgers (two writers on one file: an entry or a pin disappears, a subject
is released to two silo sets, the budget is spent twice over) and on the agent (a second agent starts on a
directory in use).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.dir_lock import AGGREGATOR_LOCK, DirectoryBusy, DirectoryLock
from fedlt.keepalive import aggregator_options
from privacy.dp.accountant import epsilon, gaussian_rdp
from privacy.dp.ledger import Budget, BudgetExceeded, LedgerError, PrivacyLedger
from privacy.pki.errors import PkiError
from privacy.pki.roster import Roster
from silo.__main__ import main as silo_main
from silo.agent import SiloAgent
from silo.budget import PRIVACY_LEDGER
from silo.config import load_silo_config
from silo.releases import LEDGER, LedgerMissing, ReleaseLedger, RepeatedRelease
from tests.consortium_harness import write_kit

BUDGET = Budget(1.5, 1e-5)
SMALL = gaussian_rdp(noise_multiplier=8.0)
FITTING = max(k for k in range(1, 50) if epsilon(k * SMALL, BUDGET.delta) <= BUDGET.epsilon)


# ---------------------------------------------------------------- the privacy ledger


def test_two_writers_of_one_privacy_ledger_keep_every_entry(tmp_path):
    """The attack: two ledger objects on one file (two agents, or an agent and another process), charging in
    turn. Each used to write its own entries over the other's, so the file kept only the last writer's."""
    path = tmp_path / "privacy-ledger.json"
    first, second = PrivacyLedger(BUDGET, path), PrivacyLedger(BUDGET, path)
    for k in range(3):
        first.charge("gaussian", 0.01 * SMALL, what=f"first {k}")
        second.charge("gaussian", 0.01 * SMALL, what=f"second {k}")
    kept = [e["what"] for e in PrivacyLedger(BUDGET, path).entries]
    assert kept == [f"{who} {k}" for k in range(3) for who in ("first", "second")]
    assert second.entries == PrivacyLedger(BUDGET, path).entries


def test_two_writers_cannot_both_spend_the_budget(tmp_path):
    """The attack: a second writer opened before the first spent the budget still sees it whole and spends
    it again. Every charge re-reads the file under its lock, so the second is refused."""
    path = tmp_path / "privacy-ledger.json"
    first, second = PrivacyLedger(BUDGET, path), PrivacyLedger(BUDGET, path)
    for _ in range(FITTING):
        first.charge("gaussian", SMALL, what="a release")
    with pytest.raises(BudgetExceeded, match="past its budget"):
        second.charge("gaussian", SMALL, what="a release")
    assert len(PrivacyLedger(BUDGET, path).entries) == FITTING


CHARGE = """
import sys
from pathlib import Path
from privacy.dp.accountant import gaussian_rdp
from privacy.dp.ledger import Budget, BudgetExceeded, PrivacyLedger

ledger = PrivacyLedger(Budget(float(sys.argv[2]), float(sys.argv[3])), Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
admitted = 0
for _ in range(int(sys.argv[4])):
    try:
        ledger.charge("gaussian", gaussian_rdp(noise_multiplier=8.0), what="a release")
        admitted += 1
    except BudgetExceeded:
        pass
print(admitted, flush=True)
"""


def test_two_processes_charging_at_once_admit_exactly_the_budget(tmp_path):
    """The attack across processes: two writers open the ledger, then both charge as fast as they can until
    refused. Together they may admit only what one ledger admits, and the file records every admission."""
    path = tmp_path / "privacy-ledger.json"
    args = [str(path), str(BUDGET.epsilon), str(BUDGET.delta), str(FITTING)]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", CHARGE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for w in writers:
            assert w.stdout.readline().strip() == "ready"
        for w in writers:
            w.stdin.write("go\n")
            w.stdin.flush()
        admitted = [int(w.communicate(timeout=300)[0]) for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait()
    assert sum(admitted) == FITTING
    assert len(PrivacyLedger(BUDGET, path).entries) == FITTING


# ---------------------------------------------------------------- the release ledger


def test_two_writers_of_one_release_ledger_keep_every_pin(tmp_path):
    """The attack: two release ledgers on one state directory pinning rounds in turn; each used to write its
    own book over the other's, so pins vanished (and with them the refusal of a second release)."""
    first, second = ReleaseLedger(tmp_path), ReleaseLedger(tmp_path)
    for k in range(3):
        first.pin_survivors(f"first/{k}", ["a", "b", "c"], "a contribution")
        second.pin_survivors(f"second/{k}", ["a", "b", "c"], "a contribution")
    second.note_privacy_ledger()
    first.record_disclosure("state/1", b"means")
    book = ReleaseLedger(tmp_path)
    for k in range(3):
        assert book.survivors(f"first/{k}") == book.survivors(f"second/{k}") == ["a", "b", "c"]
    assert book.keeps_privacy_ledger
    assert book.disclosure("state/1") == b"means"


def test_two_writers_cannot_release_one_subject_to_two_silo_sets(tmp_path):
    """The attack the release ledger exists for, through two writers: one pins a round to {a, b, c}, the
    other (opened before) to {a, b, c, v}; the two sums would subtract to v's contribution."""
    first, second = ReleaseLedger(tmp_path), ReleaseLedger(tmp_path)
    first.pin_survivors("round/1", ["a", "b", "c"], "contribution of round 1")
    with pytest.raises(RepeatedRelease, match="already signed the contribution of round 1 for a, b, c"):
        second.pin_survivors("round/1", ["a", "b", "c", "v"], "contribution of round 1")
    assert ReleaseLedger(tmp_path).survivors("round/1") == ["a", "b", "c"]


# ---------------------------------------------------------------- many writers behave as one ledger


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0.25, 0.5, 1.0, 2.0])), max_size=10))
def test_writers_on_one_privacy_ledger_admit_what_one_ledger_admits(charges):
    """Property: any interleaving of charges through three ledger objects on one file admits and refuses
    exactly as one ledger fed the same charges, and the file ends up with every admitted entry."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "privacy-ledger.json"
        writers = [PrivacyLedger(BUDGET, path) for _ in range(3)]
        one = PrivacyLedger(BUDGET)
        for k, (writer, scale) in enumerate(charges):
            outcomes = [_admitted(ledger, scale * SMALL, f"release {k}") for ledger in (writers[writer], one)]
            assert outcomes[0] == outcomes[1]
        kept = [(e["what"], e["rdp"]) for e in PrivacyLedger(BUDGET, path).entries]
        assert kept == [(e["what"], e["rdp"]) for e in one.entries]


def _admitted(ledger: PrivacyLedger, rdp, what: str) -> bool:
    try:
        ledger.charge("gaussian", rdp, what=what)
    except BudgetExceeded:
        return False
    return True


SETS = [["a", "b", "c"], ["a", "b", "c", "v"], ["b", "c", "v"]]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.sampled_from(SETS)), max_size=12))
def test_writers_on_one_release_ledger_refuse_what_one_ledger_refuses(pins):
    """Property: any interleaving of pins through three release ledgers on one state directory refuses a
    second silo set for a subject exactly as one ledger does, and the file keeps every pin."""
    with tempfile.TemporaryDirectory() as directory:
        shared, alone = Path(directory) / "shared", Path(directory) / "alone"
        shared.mkdir()
        alone.mkdir()
        writers = [ReleaseLedger(shared) for _ in range(3)]
        one = ReleaseLedger(alone)
        for writer, key, survivors in pins:
            outcomes = [_pinned(ledger, f"round/{key}", survivors) for ledger in (writers[writer], one)]
            assert outcomes[0] == outcomes[1]
        for key in range(3):
            assert ReleaseLedger(shared).survivors(f"round/{key}") == one.survivors(f"round/{key}")


def _pinned(ledger: ReleaseLedger, key: str, survivors: list[str]) -> bool:
    try:
        ledger.pin_survivors(key, survivors, "a contribution")
    except RepeatedRelease:
        return False
    return True


# ---------------------------------------------------------------- re-reading still fails closed


def test_a_privacy_ledger_that_lost_entries_while_the_silo_ran_is_refused_not_rewritten(tmp_path):
    """Re-reading must not turn a lost ledger into a fresh budget: a file deleted, or put back from an older
    copy, under a running writer is a LedgerError at its next charge, and the file is left as it was."""
    path = tmp_path / "privacy-ledger.json"
    ledger = PrivacyLedger(BUDGET, path)
    ledger.charge("gaussian", SMALL, what="first")
    older = path.read_bytes()
    ledger.charge("gaussian", SMALL, what="second")
    path.write_bytes(older)
    with pytest.raises(LedgerError, match="restore it from a backup"):
        ledger.charge("gaussian", SMALL, what="third")
    assert path.read_bytes() == older
    path.unlink()
    with pytest.raises(LedgerError, match="entries this silo recorded are gone"):
        ledger.keep()
    assert not path.exists()


def test_a_release_ledger_that_lost_pins_while_the_silo_ran_is_refused_not_rewritten(tmp_path):
    """The same for the release ledger: an older copy put back, or the file deleted, under a running writer
    stops its next change (a lost pin would let the same data be released again to other silos)."""
    ledger = ReleaseLedger(tmp_path)
    path = tmp_path / LEDGER
    older = path.read_bytes()
    ledger.pin_survivors("round/1", ["a", "b", "c"], "contribution of round 1")
    path.write_bytes(older)
    with pytest.raises(LedgerMissing, match="replaced by an older copy"):
        ledger.pin_survivors("round/1", ["a", "b", "c", "v"], "contribution of round 1")
    assert path.read_bytes() == older
    path.unlink()
    with pytest.raises(LedgerMissing, match="was removed while this silo ran"):
        ledger.record_disclosure("state/1", b"means")
    assert not path.exists()


def test_a_damaged_release_ledger_is_a_clear_error(tmp_path):
    (tmp_path / LEDGER).write_text('{"survivors": ')
    with pytest.raises(LedgerMissing, match="not a readable release ledger"):
        ReleaseLedger(tmp_path)


# ---------------------------------------------------------------- one agent per state directory

HOLD = """
import sys
from pathlib import Path
from fedlt.dir_lock import DirectoryLock

state_dir = Path(sys.argv[1])
state_dir.mkdir(parents=True, exist_ok=True)
lock = DirectoryLock.take(state_dir)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder():
    """Start a process that takes a state directory's lock and keeps it until killed (always, at the end)."""
    started: list[subprocess.Popen] = []

    def hold(state_dir: Path) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(state_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        assert process.stdout.readline().strip() == "held"
        return process

    yield hold
    for process in started:
        process.kill()
        process.wait()


def test_a_second_lock_of_a_state_directory_names_the_holder_and_waits_for_nothing(tmp_path):
    lock = DirectoryLock.take(tmp_path)
    with pytest.raises(DirectoryBusy) as busy:
        DirectoryLock.take(tmp_path)
    message = str(busy.value)
    assert f"the state directory {tmp_path} is in use by another silo agent" in message
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    lock.release()
    DirectoryLock.take(tmp_path).release()


def test_a_second_agent_on_a_state_directory_stops_before_touching_it(tmp_path):
    """The finding's setup: two agents of one silo on its one state directory. The second stops at start,
    naming the directory and the first agent's pid, and writes nothing there."""
    (config,) = write_kit(tmp_path)[:1]
    first = SiloAgent(load_silo_config(config))
    before = _files(first.state_dir)
    with pytest.raises(DirectoryBusy, match=f"pid {os.getpid()} on "):
        SiloAgent(load_silo_config(config))
    assert _files(first.state_dir) == before
    first.state_lock.release()
    SiloAgent(load_silo_config(config)).state_lock.release()


def test_an_agent_whose_start_failed_leaves_the_directory_free(tmp_path):
    """A start that fails after taking the lock (here: a kit roster below the policy's quorum floor) does not
    keep the directory from the next start in the same process, though the failed agent lingers in a
    reference cycle with its exception until collected; a live agent still counts."""
    (config,) = write_kit(tmp_path)[:1]
    silo = load_silo_config(config)
    kit = silo.path(silo.connection.roster)
    good = kit.read_bytes()
    kit.write_bytes(replace(Roster.read(kit), quorum=1).to_json())
    with pytest.raises(PkiError, match="not pinning the enrollment kit's roster"):
        SiloAgent(load_silo_config(config))
    kit.write_bytes(good)
    agent = SiloAgent(load_silo_config(config))
    with pytest.raises(DirectoryBusy):
        SiloAgent(load_silo_config(config))
    agent.state_lock.release()


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_silo_run_on_a_state_directory_in_use_exits_2_saying_so(tmp_path, holder):
    """`python -m silo run` against a directory another process holds: exit 2, one error line naming the
    directory and the holder's pid, no traceback."""
    (config,) = write_kit(tmp_path)[:1]
    state_dir = load_silo_config(config).path(load_silo_config(config).state_dir)
    held = holder(state_dir)
    run = subprocess.run(
        [sys.executable, "-m", "silo", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith(f"error: the state directory {state_dir} is in use by another silo agent")
    assert f"(pid {held.pid} on " in run.stderr
    assert "Traceback" not in run.stderr


def test_a_killed_agents_lock_is_released_by_its_death(tmp_path, holder):
    """A SIGKILLed holder leaves no stale lock: the kernel drops it with the process, and the directory can
    be taken at once (the lock file stays, naming the dead holder, and is simply taken over)."""
    held = holder(tmp_path)
    with pytest.raises(DirectoryBusy, match=f"pid {held.pid} on "):
        DirectoryLock.take(tmp_path)
    held.send_signal(signal.SIGKILL)
    held.wait()
    lock = DirectoryLock.take(tmp_path)
    with pytest.raises(DirectoryBusy, match=f"pid {os.getpid()} on "):
        DirectoryLock.take(tmp_path)
    lock.release()


def test_silo_budget_reads_the_ledger_while_the_agent_holds_the_directory(tmp_path, capsys):
    """`silo budget` only reads (the ledger is replaced atomically, so it never sees half a file): it needs
    no lock and works beside a running agent."""
    (config,) = write_kit(tmp_path)[:1]
    silo = load_silo_config(config)
    state_dir = silo.path(silo.state_dir)
    state_dir.mkdir(parents=True)
    lock = DirectoryLock.take(state_dir)
    PrivacyLedger(Budget(silo.dp.epsilon, silo.dp.delta), state_dir / PRIVACY_LEDGER).charge(
        "gaussian", SMALL, what="record count"
    )
    assert silo_main(["budget", "--config", str(config)]) == 0
    assert "1 entries" in capsys.readouterr().out
    lock.release()


def test_a_second_aggregator_on_a_data_directory_stops_saying_so(tmp_path):
    """Found walking through the operator guide: a second `aggregator serve` on one data directory started
    and shared the silos with the first, and no round completed, with no word in any log."""
    write_kit(tmp_path)
    data_dir = tmp_path / "aggregator-data"
    data_dir.mkdir()
    held = DirectoryLock.take(data_dir, name=AGGREGATOR_LOCK)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "aggregator", "serve", "--config", str(tmp_path / "consortium.toml")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        held.release()
    assert done.returncode == 2, done.stderr
    assert f"the data directory {data_dir} is in use by another aggregator (pid {os.getpid()}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_second_aggregator_cannot_bind_the_first_ones_port():
    """gRPC sets SO_REUSEPORT unless told not to: two aggregators then listened on one port and each held
    some of the silos' connections."""
    first = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=aggregator_options(30.0))
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=aggregator_options(30.0))
        with pytest.raises(RuntimeError):  # grpcio raises where the bind fails
            assert second.add_insecure_port(f"127.0.0.1:{port}") == 0
    finally:
        first.stop(0)
