"""One silo, several studies: one agent process per study, one state directory, one budget, one gate.

`python -m silo run --config silo.toml` with `[study.<id>]` tables starts `python -m silo run --config
silo.toml --study <id>` for each study (`Supervisor`): a process each, so that one study's crash or memory
never takes another down, and torch's process-wide random generator and thread settings stay one study's.
It forwards SIGINT and SIGTERM to them, logs each one's exit, and exits with 0 once every study finished,
else with the worst code.

Every study's agent shares what the silo keeps across its studies, at the top of `state_dir`: the release
ledger, the privacy ledger (both locked and re-read at each write, so two agents together can neither pass
the budget nor release one subject over two silo sets), the pinned roster and revocations, the mask secret.
Each keeps its own progress, pending upload, keys and directory lock in `studies/<id>/`. Each also holds the
state directory's own lock shared (`RootHold`), so that an agent without studies, which holds it exclusively,
never runs on the same directory beside them.

A silo that ran the aggregator's default study before it had `[study.*]` tables kept that study's files at the
top of `state_dir`; the agent of `[study.main]` (`fedlt.studies.DEFAULT_STUDY`) moves them into its folder at
its first start (`adopt_single_run`), so the default study goes on where it was.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from fedlt.aggregation import layer_names, record
from fedlt.dir_lock import AGENT_LOCK, DirectoryBusy
from fedlt.studies import DEFAULT_STUDY
from silo.export import STEPPED

log = logging.getLogger("silo")

PR_SET_PDEATHSIG = 1  # prctl(2)
# a study's own files, which a silo without studies keeps at the top of its state directory
SINGLE_RUN_FILES = ("progress.json", "pending.json", "pending.bin", STEPPED)


class RootHold:
    """The state directory's agent lock, held shared by every study's agent for its life: an agent without
    studies takes it exclusively (`fedlt.dir_lock.DirectoryLock`), so the two kinds never run on one
    directory at once."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / AGENT_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryBusy(
                f"the state directory {root} is in use by a silo agent without studies (silo.toml without "
                "[study.<id>] tables): it and the agents of studies would keep one silo's records twice. "
                "Stop it first"
            ) from None
        self._close = weakref.finalize(self, os.close, fd)  # on release, collection or interpreter exit

    def release(self) -> None:
        self._close()


def single_run_items(root: Path) -> list[Path]:
    """The default study's files a silo without studies left at the top of `root`: its progress, pending
    upload, stepped state and the key service's folders."""
    names = [*SINGLE_RUN_FILES, *(n for n in layer_names() if record(n).key_service is not None)]
    return [root / name for name in names if (root / name).exists()]


def adopt_single_run(root: Path, study_dir: Path) -> None:
    """Move the default study's files from the top of `root` into its folder, `study_dir`, at the first start
    of `[study.main]` (its agent holds `study_dir`'s lock, and no agent without studies runs: `RootHold`). A
    folder that holds any of them already is left as it is, and the files at the top with it, saying so."""
    found = single_run_items(root)
    if not found:
        return
    clashing = [p.name for p in found if (study_dir / p.name).exists()]
    if clashing:
        log.warning(
            "%s holds files of the default study from before [study.*] tables (%s), and so does %s: "
            "keeping both as they are; this agent goes on from %s",
            root,
            ", ".join(p.name for p in found),
            study_dir,
            study_dir,
        )
        return
    for path in found:
        os.replace(path, study_dir / path.name)
    log.info(
        "moved the default study's %s from %s into %s (its folder, now that silo.toml names studies)",
        ", ".join(p.name for p in found),
        root,
        study_dir,
    )


def note_single_run(root: Path, studies: Sequence[str]) -> None:
    """At the start of a silo with studies: say so if the default study's files from before its tables stay
    where nothing reads them (no `[study.main]` table)."""
    found = single_run_items(root)
    if found and DEFAULT_STUDY not in studies:
        log.warning(
            "%s holds the aggregator's default study's %s from before silo.toml named studies; add a "
            "[study.%s] table to go on with that study (its agent takes them over at its start)",
            root,
            ", ".join(p.name for p in found),
            DEFAULT_STUDY,
        )


class Supervisor:
    """Runs one agent process per study until all have ended. `command` gives the command line of a study's
    agent (`python -m silo run --config silo.toml --study <id>`)."""

    def __init__(self, studies: Sequence[str], command: Callable[[str], list[str]]) -> None:
        self.studies, self.command = tuple(studies), command
        self.processes: dict[str, subprocess.Popen] = {}
        self._ended: queue.Queue[tuple[str, int]] = queue.Queue()
        self._lock = threading.RLock()  # `stop` runs in a signal handler, maybe while `start` holds it
        self._stopping = False

    def run(self) -> int:
        """Start every study's agent, wait for each to end; 0 if every one finished, else the worst code."""
        self.start()
        return self.wait()

    def start(self) -> None:
        with self._lock:
            for study in self.studies:
                if self._stopping:
                    break
                process = subprocess.Popen(self.command(study), preexec_fn=_with_parent(os.getpid()))
                self.processes[study] = process
                threading.Thread(target=self._watch, args=(study, process), daemon=True).start()
                log.info("study %r: its agent started (pid %d)", study, process.pid)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask every study's agent to stop (each keeps its progress and stops on its own)."""
        with self._lock:
            self._stopping = True
            running = [(s, p) for s, p in self.processes.items() if p.poll() is None]
        for study, process in running:
            log.info("study %r: asking its agent to stop (%s)", study, signal.Signals(signum).name)
            process.send_signal(signum)

    def wait(self) -> int:
        codes = []
        for _ in range(len(self.processes)):
            study, code = self._ended.get()
            if self._stopping and code in (-signal.SIGTERM, -signal.SIGINT):
                code = 0  # asked to stop before its agent had set its own handlers: stopped all the same
            codes.append(code)
            log.log(logging.INFO if code == 0 else logging.ERROR, "study %r: %s", study, _ended(code))
        worst = max(map(_exit_code, codes), default=0)
        log.info("every study's agent has ended; exiting with %d", worst)
        return worst

    def _watch(self, study: str, process: subprocess.Popen) -> None:
        self._ended.put((study, process.wait()))


def _with_parent(parent: int) -> Callable[[], None]:
    """A study's agent gets SIGTERM when the supervisor dies, even by SIGKILL (Linux's parent-death
    signal), so no agent is left running without the process its administrator starts and stops."""

    def die_with_parent() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the signal was asked for
            os._exit(1)

    return die_with_parent


def _ended(code: int) -> str:
    if code == 0:
        return "its agent ended (finished, or stopped on request)"
    if code < 0:
        return f"its agent was killed by {signal.Signals(-code).name}; the other studies go on"
    return f"its agent exited with code {code} (its log lines above say why); the other studies go on"


def _exit_code(code: int) -> int:
    """As a shell reports it, 128 + N for a process killed by signal N: worse than any exit code."""
    return 128 - code if code < 0 else code


def forward_signals(supervisor: Supervisor) -> Callable[[], None]:
    """SIGINT and SIGTERM stop every study's agent; the returned function puts the former handlers back."""
    former = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in former:
        signal.signal(sig, lambda *_: supervisor.stop())

    def restore() -> None:
        for sig, handler in former.items():
            signal.signal(sig, handler)

    return restore
