"""`python -m aggregator export`: a committed model from the aggregator's store, as weights and a model card.

The store is opened read-only (SQLite `mode=ro`) inside one read transaction, so the command changes nothing,
runs on a stopped aggregator and beside a serving one (the write-ahead log lets a reader in while it commits),
and sees one consistent round. The state is checked against the digest the store keeps beside it, and a store
bound to other settings than the config given is refused: that config's plan would describe other weights.
Where only silos can read the state (ckks seals it), there is nothing the aggregator can export; the command
says so and names the silos' command (`silo.export`).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aggregator.catalog import study_text
from aggregator.config import ConsortiumConfig, load_consortium_config, load_study_config
from aggregator.held_state import HeldState
from aggregator.store import DATABASE
from fedlt.export import (
    CARD,
    README,
    WEIGHTS,
    ExportError,
    accuracy_by_class,
    check_out_dir,
    utc,
    write_export,
)
from fedlt.methods import Method
from fedlt.tensorpack import PackError

# how long a read waits for a serving aggregator's checkpoint to let go of the database
BUSY_SECONDS = 30.0


@dataclass(frozen=True)
class StoredRound:
    """What the store keeps of one committed round, and of the run around it."""

    round: int
    latest: int
    digest: str
    data: bytes
    committed_ms: int
    round_id: str
    contributors: list[str]
    metrics: dict | None
    epsilon: dict[str, float | None]  # each registered silo's last report (None: it reports none)


def export_model(
    config_path: str | Path,
    out: Path,
    *,
    round_number: int | None = None,
    study: str = "",
    echo: Callable = print,
) -> int:
    config = load_consortium_config(config_path)
    text = study_text(config.path(config.server.data_dir), study) if study else None
    if text is not None:
        config = load_study_config(study, text, config)
    check_out_dir(out)
    stored = read_round(config, config_path, round_number)
    method = config.plan.build_method()
    held = _held(stored, method)
    if held.model is None:
        raise ExportError(
            f"the aggregator holds round {stored.round}'s state sealed by the silos (privacy layer "
            f"{config.consortium.privacy}): it cannot read the model, so only silos can export it. On a "
            f"silo: python -m silo export --config silo.toml --out {out}"
        )
    card = write_export(out, plan=config.plan, method=method, state=held.model, facts=_facts(config, stored))
    echo(
        f"exported round {stored.round} of {stored.latest} of consortium {config.consortium.id!r} "
        f"({config.plan.method.name} over {config.consortium.privacy}) to {out}: {WEIGHTS} (SHA-256 "
        f"{card['weights']['sha256'][:16]}…), {CARD}, {README}"
    )
    echo(f'load it with: from fedlt.export import load_exported; model, card = load_exported("{out}")')
    return 0


def read_round(config: ConsortiumConfig, config_path: str | Path, round_number: int | None) -> StoredRound:
    """Round `round_number` (default: the last committed) as the store keeps it, read in one snapshot."""
    data_dir = config.path(config.server.data_dir)
    path = data_dir / DATABASE
    if not data_dir.is_dir():
        raise ExportError(
            f"no such data directory {data_dir} (server.data_dir of {config_path}); the aggregator keeps its "
            "store there once it has served"
        )
    if not path.is_file():
        raise ExportError(f"{data_dir} holds no aggregator store ({DATABASE}): has this aggregator served?")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_SECONDS)
    except sqlite3.Error as exc:
        raise ExportError(f"cannot open the store {path} read-only: {exc}") from None
    try:
        db.execute("BEGIN")
        return _read(db, config, config_path, path, round_number)
    except sqlite3.OperationalError as exc:
        raise ExportError(
            f"cannot read the store {path}: {exc} (a serving aggregator holds it only for moments: try "
            "again; and run the export as the aggregator's user, who alone may read its data directory)"
        ) from None
    finally:
        db.close()


def _read(
    db: sqlite3.Connection,
    config: ConsortiumConfig,
    config_path: str | Path,
    path: Path,
    round_number: int | None,
) -> StoredRound:
    bound = db.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone()
    if bound is not None and bound[0] != config.fingerprint():
        raise ExportError(
            f"{path} holds a consortium run with other settings than {config_path}: export with the "
            "consortium.toml that run used"
        )
    (latest,) = db.execute("SELECT COALESCE(MAX(round), 0) FROM states").fetchone()
    if latest == 0:
        raise ExportError(f"no round is committed yet in {path}: nothing has been trained to export")
    wanted = latest if round_number is None else round_number
    if not 1 <= wanted <= latest:
        raise ExportError(f"round {wanted} is not committed in {path}: rounds 1 to {latest} are")
    row = db.execute(
        "SELECT digest, data, committed_ms, round_id, contributors FROM states WHERE round = ?", (wanted,)
    ).fetchone()
    digest, data, committed_ms, round_id, contributors = row
    if not data:
        raise ExportError(
            f"the weights of round {wanted} were not kept ([retention] of {config_path} keeps the last "
            f"{config.retention.last} rounds'{_every(config.retention.every)}); rounds whose weights are "
            f"kept: {', '.join(map(str, _kept_rounds(db)))}"
        )
    metrics = db.execute("SELECT metrics FROM metrics WHERE round = ?", (wanted,)).fetchone()
    return StoredRound(
        round=wanted,
        latest=latest,
        digest=digest,
        data=bytes(data),
        committed_ms=committed_ms,
        round_id=round_id,
        contributors=json.loads(contributors),
        metrics=json.loads(metrics[0]) if metrics else None,
        epsilon=_reported_epsilon(db),
    )


def _kept_rounds(db: sqlite3.Connection) -> list[int]:
    rows = db.execute("SELECT round FROM states WHERE round > 0 AND length(data) > 0 ORDER BY round")
    return [r for (r,) in rows]


def _reported_epsilon(db: sqlite3.Connection) -> dict[str, float | None]:
    """Each registered silo's last reported ε left (None: it reports none)."""
    return dict(db.execute("SELECT silo_id, privacy_remaining FROM silos ORDER BY silo_id"))


def _held(stored: StoredRound, method: Method) -> HeldState:
    try:
        return HeldState.from_stored(stored.data, stored.round, stored.digest, method)
    except (ValueError, PackError) as exc:
        raise ExportError(
            f"the stored state of round {stored.round} is damaged ({exc}); export another round (--round)"
        ) from None


def _facts(config: ConsortiumConfig, stored: StoredRound) -> dict[str, Any]:
    """What the card says beyond the plan and the state, from the config and the store."""
    return {
        "consortium": config.consortium.id,
        "exported_by": "the aggregator",
        "privacy": config.consortium.privacy,
        "rounds": {"committed": stored.latest, "planned": config.consortium.rounds},
        "state": {
            "round_id": stored.round_id,
            "committed_at": utc(stored.committed_ms / 1000),
            "contributors": stored.contributors,
        },
        "evaluation": _evaluation(config, stored),
        "silos": _silos(stored),
        "attestations": None,
    }


def _evaluation(config: ConsortiumConfig, stored: StoredRound) -> dict[str, Any]:
    if stored.metrics is None:
        return {
            "accuracy": None,
            "why": f"the store has no evaluation of round {stored.round} ([evaluation] was not set, or the "
            "round was not evaluated)",
        }
    evaluation = config.evaluation
    if evaluation.dataset:
        split = f"the {evaluation.dataset} test split, {evaluation.test_per_class} per class"
        where = f"the operator's evaluation set ({split})"
    else:
        where = "the silos' held-out data (their per-class counts, summed)"
    known = evaluation.class_counts or stored.metrics.get("many") is not None
    shot_groups: dict[str, str] | str = (
        config.metrics.rules()
        if known
        else "unknown: the training counts per class were not given ([evaluation] class_counts) nor summed "
        "by the silos (held-out evaluation sums them in round 1)"
    )
    return {
        **accuracy_by_class(stored.metrics, config.plan.model.classes),
        "on": where,
        "shot_groups": shot_groups,
    }


def _every(rounds: int) -> str:
    return f" and every {rounds}th round's" if rounds else ""


def _silos(stored: StoredRound) -> dict[str, Any]:
    return {
        "note": "The ε each silo's budget had left when it last reported it; a silo reports it only if its "
        "policy (dp.report) says to.",
        "epsilon_remaining": stored.epsilon,
    }
