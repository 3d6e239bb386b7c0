"""The studies one aggregator hosts: which run now, which wait, and where each silo call goes.

`Studies` keeps the catalog (`aggregator.catalog`) and the runs (`aggregator.study_run`): at most `[server]
max_studies` run at once, the rest wait in the order they were created; a study that ends, is paused or
cancelled frees its slot for the next. Every change the operator makes is written to the study's own audit
log with the operator's name. `StudyRouter` is the one `ConsortiumService` the gRPC server serves: each call
goes to the run of the study its metadata names (`fedlt.studies`), or of the default study when it names none.
A study that is not running answers what its silos need to wait or to stop: UNAVAILABLE while it is queued or
paused, and for a finished one a `finished` directive, so their agents end instead of retrying.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from aggregator.catalog import (
    CANCELLABLE,
    CATALOG,
    PAUSABLE,
    RESUMABLE,
    STUDIES,
    Catalog,
    StudyError,
    StudyInfo,
    UnknownStudy,
    WrongState,
)
from aggregator.config import ConsortiumConfig, load_study_config
from aggregator.status_page import aggregator_snapshot, audit_tally, snapshot, standing, study_entry
from aggregator.store import DATABASE, Store, StoreError
from aggregator.study_run import Shared, StudyRun, dp_line
from fedlt.errors import FedltError
from fedlt.studies import study_of
from fedlt.telemetry.prometheus import ConsortiumFacts
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc
from privacy.pki.errors import PkiError
from privacy.pki.identity import silo_id_of

log = logging.getLogger("aggregator")


class Studies:
    """Implements `aggregator.catalog.StudyControl` for the operator's commands; `base` is consortium.toml's
    config (its [server] serves every study), `shared` what every run is given."""

    def __init__(
        self, base: ConsortiumConfig, shared: Shared, *, echo: Callable[[str], None] = print
    ) -> None:
        self.base, self.shared, self.echo = base, shared, echo
        self.data_dir = base.path(base.server.data_dir)
        self.catalog = _open_catalog(base, self.data_dir)
        self._default = self.catalog.default()
        self.runs: dict[str, StudyRun] = {}
        self.failed: list[str] = []  # studies that stopped on an error while this aggregator served
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stopping = False
        self._launched = 0  # runs started while this aggregator served
        self._closing: set[StudyRun] = set()  # runs that ended and are writing their last words
        self._starting = False  # within `start`: the default study failing to start stops the aggregator

    # --- running ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run what ran when the aggregator stopped, then what waits, up to `max_studies`."""
        with self._lock:
            self._starting = True
            try:
                self._schedule()
            finally:
                self._starting = False

    def _schedule(self) -> None:
        """Fill the free slots: studies left running by a restart first, then the queue in order; studies
        beyond the slots (`max_studies` lowered) wait in the queue again."""
        if self._stopping:
            return
        slots = self.base.server.max_studies
        listed = self.catalog.studies()
        waiting = [s for s in listed if s.state == "running" and s.id not in self.runs]
        waiting += [s for s in listed if s.state == "queued"]
        for study in waiting:
            if len(self.runs) >= slots:
                if study.state == "running":
                    self.catalog.set_state(study.id, "queued", "waits for a free slot ([server] max_studies)")
                continue
            self._launch(study)

    def _launch(self, study: StudyInfo) -> None:
        try:
            run = StudyRun(
                study.id, self.config_of(study), self.shared, name="" if study.is_default else study.id
            )
        except (FedltError, sqlite3.DatabaseError, OSError) as exc:
            if study.is_default and self._starting and isinstance(exc, FedltError):
                raise  # consortium.toml's own study: the aggregator stops, saying why, as a single run did
            problem = exc if isinstance(exc, FedltError) else f"{self._dir(study) / DATABASE}: {exc}"
            log.error("study %r cannot start: %s", study.id, problem)
            self._cannot_start(study, problem)
            return
        except Exception as exc:  # a store or plan that cannot run: the study fails, the others go on
            log.exception("study %r cannot start", study.id)
            self._cannot_start(study, exc)
            return
        self.catalog.set_state(study.id, "running")
        run.store.audit("study_started", {"study": study.id})
        self.runs[study.id] = run
        self._launched += 1
        self.echo(run.say(f"privacy layer: {run.describe_layer()}"))
        self.echo(run.say(dp_line(run.config.plan.dp)))
        run.start(self._ended)
        self._changed.notify_all()

    def _cannot_start(self, study: StudyInfo, problem: object) -> None:
        self.catalog.set_state(study.id, "failed", f"cannot start: {problem}")
        self.failed.append(study.id)

    def config_of(self, study: StudyInfo) -> ConsortiumConfig:
        if study.is_default:
            return self.base
        return load_study_config(study.id, self.catalog.study_toml(study.id), self.base)

    def _ended(self, run: StudyRun) -> None:
        """A run's driver stopped: keep where the study stands, free its slot, start the next. When the
        aggregator stops, its runs are closed by `close`, once the server no longer takes calls."""
        with self._lock:
            if run.rounds.failure is not None:
                self.catalog.set_state(run.study, "failed", f"stopped on an error: {run.rounds.failure}")
                self.failed.append(run.study)
            elif run.finished:
                self.catalog.set_state(run.study, "done")
            # paused or cancelled: set by the operator's command; the aggregator stopping: left running
            self.catalog.keep_progress(run.study, run.progress())
            if self._stopping:
                return
            self.runs.pop(run.study, None)
            self._closing.add(run)
        run.close(self.echo)  # its plots and final table written outside the lock every call routes under
        with self._lock:
            self._closing.discard(run)
            self._schedule()
            self._changed.notify_all()

    def active(self) -> bool:
        """Whether anything runs, waits to run, or is paused (the operator will resume it)."""
        with self._lock:
            return bool(self.runs or self._closing) or any(
                s.state in ("queued", "running", "paused") for s in self.catalog.studies()
            )

    def idle_words(self) -> list[str]:
        """Why an aggregator told to exit when done stops now, where a run's own last line does not say it:
        the studies that failed, or nothing having run at all."""
        with self._lock:
            failed = [s for s in self.catalog.studies() if s.state == "failed"]
        words = [f"study {s.id!r} failed: {s.reason}" for s in failed]
        if failed or not self._launched:
            words.append(
                "nothing runs or waits on this aggregator, so it stops ([consortium] exit_when_done); "
                "`python -m aggregator study list` shows every study; set exit_when_done = false to resume "
                "or create studies"
            )
        return words

    def wait_idle(self, stop: threading.Event) -> None:
        """Return once nothing runs or waits (or `stop` is set)."""
        with self._changed:
            while not stop.is_set() and self.active():
                self._changed.wait(0.5)

    def halt(self) -> None:
        """The aggregator stops: every run halts, and its study stays `running` in the catalog, to go on."""
        with self._lock:
            self._stopping = True
            runs = list(self.runs.values())
        for run in runs:
            run.halt("aggregator stopping")

    def close(self) -> None:
        """After `halt`, once the server takes no more calls: every run's end said, its store closed."""
        with self._lock:
            closing = list(self._closing)
        for run in closing:
            run.join()  # its thread closes it
        for run in list(self.runs.values()):
            run.join()
            run.close(self.echo)
        self.runs.clear()
        self.catalog.close()

    # --- the operator's commands (aggregator.catalog.StudyControl) ---------------------------------------

    def create(self, study: str, study_toml: str, *, by: str) -> StudyInfo:
        config = load_study_config(study, study_toml, self.base)
        with self._lock:
            self.catalog.add(study, study_toml)
            self.catalog.keep_progress(study, _planned(config))
            self._note(
                study, "study_created", by, {"sha256": hashlib.sha256(study_toml.encode()).hexdigest()}
            )
            self._schedule()
            return self._info(study)

    def list(self) -> list[StudyInfo]:
        with self._lock:
            return [self._with_progress(s) for s in self.catalog.studies()]

    def pause(self, study: str, *, by: str) -> StudyInfo:
        return self._stop(study, "paused", PAUSABLE, by, f"by {by}")

    def cancel(self, study: str, *, by: str, reason: str) -> StudyInfo:
        return self._stop(study, "cancelled", CANCELLABLE, by, f"by {by}" + (f": {reason}" if reason else ""))

    def resume(self, study: str, *, by: str) -> StudyInfo:
        with self._lock:
            state = self.catalog.info(study).state
            if state not in RESUMABLE:  # said before anything is written
                raise WrongState(f"study {study!r} is {state}")
            try:
                self._note(study, "study_resumed", by)
            except (sqlite3.DatabaseError, OSError, StoreError) as exc:  # the study stays as it was
                path = self.data_dir_of(study) / DATABASE
                raise StudyError(f"study {study!r} cannot be resumed: its store {path}: {exc}") from None
            self.catalog.set_state(study, "queued", "resumed", allowed=RESUMABLE)
            self._schedule()
            return self._info(study)

    def _stop(self, study: str, state: str, allowed: tuple[str, ...], by: str, reason: str) -> StudyInfo:
        with self._lock:
            self.catalog.set_state(study, state, reason, allowed=allowed)
            self._note(study, f"study_{state}", by)
            run = self.runs.get(study)
            if run is not None:
                run.halt(f"study {study!r} {state} {reason}")
        if run is not None:
            run.join()  # its end (`_ended`) frees the slot and starts the next study
        with self._lock:
            self._changed.notify_all()
            return self._info(study)

    def _note(self, study: str, event: str, by: str, detail: dict | None = None) -> None:
        """The operator's change, in the study's own audit log (made now for a study that never ran)."""
        record = {"study": study, "by": by, **(detail or {})}
        run = self.runs.get(study)
        if run is not None:
            run.store.audit(event, record)
            return
        with _DormantStore(self.data_dir_of(study), self.shared, create=True) as store:
            store.audit(event, record)

    def status(self, study: str) -> dict:
        """The study's round table with its facts (the status RPC); a study not running, from its store."""
        with self._lock:
            info = self.catalog.info(study or self._default or "")
            run = self.runs.get(info.id)
            if run is not None:
                return {**run.rounds.inbox.status(), **run.about()}
        with self._dormant(info) as store:
            return {**dormant_status(store, info), **self._about(info)}

    def page(self, warnings: list[str]) -> dict:
        """The status page's and status.json's facts: every study, with the snapshot of each that has a
        store, the default study's also at the top (as a single run's page had them)."""
        with self._lock:
            listed = [self._with_progress(s) for s in self.catalog.studies()]
            details = {info.id: self._detail(info) for info in listed}
        default = next((details[info.id] for info in listed if info.is_default), None)
        entries = [study_entry(info, details[info.id]) for info in listed]
        return aggregator_snapshot(default, entries, consortium_id=self.base.consortium.id, warnings=warnings)

    def _detail(self, info: StudyInfo) -> dict | None:
        run = self.runs.get(info.id)
        if run is not None:
            return snapshot(run.rounds.inbox.status(), run.about(), run.store)
        with self._dormant(info) as store:
            return None if store is None else snapshot(dormant_status(store, info), self._about(info), store)

    def _about(self, info: StudyInfo) -> dict:
        """A study's facts beside its round table, from the catalog, for a study that is not running."""
        return {
            "consortium_id": self.base.consortium.id,
            "study": info.id,
            "method": info.method,
            "privacy": info.privacy,
            "total_rounds": info.total_rounds,
            "dp_enabled": info.dp_enabled,
        }

    def facts(self) -> list[ConsortiumFacts]:
        """`/metrics`' facts of every running study."""
        with self._lock:
            return [run.facts() for run in self.runs.values()]

    def _info(self, study: str) -> StudyInfo:
        return self._with_progress(self.catalog.info(study))

    def _with_progress(self, info: StudyInfo) -> StudyInfo:
        """The catalog's entry, with a running study's progress as its round table has it now."""
        run = self.runs.get(info.id)
        return info if run is None else StudyInfo(**{**info.__dict__, **run.progress()})

    def _dormant(self, info: StudyInfo) -> _DormantStore:
        return _DormantStore(self._dir(info), self.shared)

    def data_dir_of(self, study: str) -> Path:
        return self._dir(self.catalog.info(study))

    def _dir(self, info: StudyInfo) -> Path:
        return self.data_dir if info.is_default else self.data_dir / STUDIES / info.id

    # --- routing ----------------------------------------------------------------------------------------

    def route(self, study: str) -> tuple[str, StudyRun | StudyInfo]:
        """The study a call names (the default one if none) with its run if running, else with its catalog
        entry; `Unrouted` if the call cannot go anywhere now. A running study's calls never read the
        catalog: every silo call of every round passes here."""
        with self._lock:
            named = study or self._default
            if named in self.runs:
                return named, self.runs[named]
            if named is None:
                raise Unrouted(
                    grpc.StatusCode.NOT_FOUND,
                    "this aggregator has no default study: name one in [study.<id>] of silo.toml",
                )
            try:
                info = self._info(named)
            except UnknownStudy:
                raise Unrouted(grpc.StatusCode.NOT_FOUND, f"no study {named!r} on this aggregator") from None
            return named, info


class Unrouted(Exception):
    """A silo's call for a study that cannot take it now, with the status code to answer."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _DormantStore:
    """A study's store opened for one look while the study is not running (None if it has none yet)."""

    def __init__(self, data_dir: Path, shared: Shared, *, create: bool = False) -> None:
        self.path, self.shared, self.create = data_dir / DATABASE, shared, create
        self.store: Store | None = None

    def __enter__(self) -> Store | None:
        if self.create:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.create or self.path.exists():
            self.store = Store(self.path, audit_key=self.shared.audit_key)
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.store is not None:
            self.store.close()


def dormant_status(store: Store | None, info: StudyInfo) -> dict:
    """`RoundInbox.status()`'s keys for a study with no run: no round in flight, its silos as registered,
    each with the last round its contribution was counted in (from the audit log)."""
    counted: dict[str, int] = {}
    if store is not None:
        for round_number, (_, silos) in sorted(audit_tally(store.audit_log()).rounds.items()):
            counted.update(dict.fromkeys(silos, round_number))
    return {
        "committed_rounds": info.committed_rounds,
        "stage": "finished" if info.state == "done" else _stage(info),  # as a finished run's table said
        "round_id": "",
        "deadline_ms": 0,
        "participants": [],
        "submitted": [],
        "state_digest": info.state_digest,
        "silos": [
            {
                "silo_id": silo,
                "connected": False,
                "last_seen_unix_ms": seen,
                "activity": "",
                "last_contributed_round": counted.get(silo, 0),
            }
            for silo, seen in (store.silos().items() if store is not None else ())
        ],
    }


def _stage(info: StudyInfo) -> str:
    return standing(info.state, info.reason, info.queue_position)


def _planned(config: ConsortiumConfig) -> dict:
    """What the list shows of a study before it first runs."""
    return {
        "method": config.plan.method.name,
        "privacy": config.consortium.privacy,
        "total_rounds": config.consortium.rounds,
        "dp_enabled": config.plan.dp.enabled,
    }


def _open_catalog(base: ConsortiumConfig, data_dir: Path) -> Catalog:
    """The data directory's catalog; made on first use, with consortium.toml's study as the default one (a
    single run's data directory becomes that study, going on from its last committed round)."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = data_dir / CATALOG
    made = not path.exists()
    catalog = Catalog(path)
    default, wanted = catalog.default(), base.server.default_study
    if made and wanted:
        catalog.add(wanted, "", is_default=True)
        catalog.keep_progress(wanted, _planned(base))
        if (data_dir / DATABASE).exists():
            log.warning(
                "the run in %s is now study %r (the data directory's default study)", data_dir, wanted
            )
    elif default != (wanted or None):
        catalog.close()
        raise StoreError(
            f"{data_dir}'s default study is {default!r}, but [server] default_study says {wanted!r}: a data "
            "directory's default study keeps its id (set default_study back)"
        )
    elif wanted:
        _regrown(catalog, base, wanted)
    return catalog


def _regrown(catalog: Catalog, base: ConsortiumConfig, study: str) -> None:
    """consortium.toml may give its study more rounds after it was done: it goes on, as a single run did."""
    info = catalog.info(study)
    if info.state == "done" and base.consortium.rounds > info.committed_rounds:
        catalog.set_state(study, "queued", f"[consortium] rounds raised to {base.consortium.rounds}")
    catalog.keep_progress(study, {**_progress_of(info), **_planned(base)})


def _progress_of(info: StudyInfo) -> dict:
    return {"committed_rounds": info.committed_rounds, "state_digest": info.state_digest}


class StudyRouter(consortium_pb2_grpc.ConsortiumServiceServicer):
    """The server's one `ConsortiumService`: each call handed to its study's servicer (see the module)."""

    def __init__(self, studies: Studies) -> None:
        self.studies = studies

    def _servicer(self, context: grpc.ServicerContext) -> Any:
        try:
            study, found = self.studies.route(study_of(context.invocation_metadata()))
        except Unrouted as exc:
            context.abort(exc.code, exc.details)
        if isinstance(found, StudyRun):
            return found.servicer
        info = found
        if info.state in ("done", "cancelled"):
            return _FinishedStudy(self.studies, info)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"study {study!r} is {_stage(info)}")
        raise AssertionError("context.abort raises")  # for type checkers: abort never returns


def _routed(rpc: str) -> Callable:
    def handler(self: StudyRouter, request: Any, context: grpc.ServicerContext) -> Any:
        return getattr(self._servicer(context), rpc)(request, context)

    handler.__name__ = rpc
    return handler


for _rpc in pb.DESCRIPTOR.services_by_name["ConsortiumService"].methods_by_name:
    setattr(StudyRouter, _rpc, _routed(_rpc))


class _FinishedStudy:
    """A done or cancelled study's answers: registration as ever, and a `finished` directive on joining, so
    its silos' agents end; anything else is refused."""

    def __init__(self, studies: Studies, info: StudyInfo) -> None:
        self.shared, self.info = studies.shared, info
        self.consortium = studies.base.consortium.id

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        pem = context.auth_context()["x509_pem_cert"][0]
        silo = silo_id_of(self.shared.identity.certificate(context))
        try:
            self.shared.members.silo(pem, silo)
        except PkiError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.RegisterResponse(
            silo_id=silo,
            consortium_id=self.consortium,
            aggregator_certificate=self.shared.certificate_pem,
            roster=self.shared.roster.raw(),
            crl=self.shared.identity.revocations.current()[0],
        )

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Iterator[pb.JoinResponse]:
        info = self.info
        yield pb.JoinResponse(
            finished=pb.Finished(rounds=info.committed_rounds, state_digest=info.state_digest)
        )

    def __getattr__(self, rpc: str) -> Callable:
        def refused(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"study {self.info.id!r} is {self.info.state}")

        return refused
