"""A whole consortium in one process: every silo's half, the privacy layer and the server half, in rounds.

After each round the global state and the metrics so far are written atomically to the run folder, so a
killed run loses at most the round in flight and the same command resumes it. All randomness is derived from
(seed, round, silo), which makes a resumed run identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedlt.aggregation import Contribution, make_layer
from fedlt.atomic import atomic_write, atomic_write_text
from fedlt.config import as_table, as_toml
from fedlt.data.arrays import LabeledData
from fedlt.data.federation import Federation, build_federation
from fedlt.device import resolve_device
from fedlt.dp import silo_privacy
from fedlt.errors import FedltError
from fedlt.methods import GlobalState, Method, ModelSpec, ServerContext, SiloContext, method_class
from fedlt.methods.local import PrivateRound
from fedlt.models import default_model
from fedlt.recorder import RunRecorder, round_line
from fedlt.selection import (
    SelectionBook,
    SelectionConfig,
    choose_participants,
    class_mean_disclosure,
    estimate_coverage,
    mask_stream,
    simulated_mask_secret,
)
from fedlt.sim.backend import Backend, open_backend
from fedlt.sim.config import SimConfig
from fedlt.telemetry import TENSORBOARD, open_telemetry
from fedlt.telemetry.to_mlflow import target_from_environment

if TYPE_CHECKING:
    from fedlt.data.table import TableLayout

CHECKPOINT = "checkpoint.pt"


class RunFolderError(FedltError):
    """The run folder holds a checkpoint this run cannot continue."""


@dataclass(frozen=True)
class RunResult:
    metrics: dict
    table: str
    state: GlobalState


def run_simulation(
    config: SimConfig,
    out: Path,
    *,
    echo: Callable[[str], None] = print,
    on_round: Callable[[int, int, dict], None] | None = None,
    federation: Federation | None = None,
) -> RunResult:
    """`federation` replaces the one `config.data` describes (the privacy audit trains on silos it has
    edited); a resumed run must be given the same."""
    device = resolve_device(config.train.device, setting="train.device")  # no such GPU: refused before work
    federation = federation or build_federation(config.data, seed=config.seed)
    method = make_method(
        config, federation.test.input_shape, len(federation.classes), table=federation.layout
    )
    layer = make_layer(config.privacy)
    out.mkdir(parents=True, exist_ok=True)
    state, rounds, book, layer_saved, ledgers = _resume(out, config, method) or (
        method.init_state(seed=config.seed),
        [],
        SelectionBook(),
        {},
        {},
    )
    layer.restore(layer_saved)
    if rounds:
        echo(f"resuming {out} after round {state.round}")
    recorder = RunRecorder(
        out,
        title=run_title(config),
        test=federation.test,
        train_counts=federation.train_counts,
        thresholds=config.metrics,
        header={
            "config": as_table(config),
            "dataset": _dataset_facts(config, federation),
            "device": str(device),  # not in the config's table (a run resumes on any device): said here
        },
        rounds=rounds,
        device=device,
        telemetry=open_telemetry(
            out / TENSORBOARD,
            history=rounds,
            classes=federation.classes,
            mlflow=target_from_environment(run_name=out.name, key=str(out.resolve())),
        ),
    )
    atomic_write_text(out / "config.toml", as_toml(config))
    silos = {f"silo-{k}": silo for k, silo in enumerate(federation.silos)}
    private = _silo_privacy(config, method, silos, ledgers)
    with open_backend(config.sim, silos) as backend:
        begun = _begin(config, method, state, silos, private, book, backend)
        finished = time.perf_counter()
        while begun is not None:
            r, total, picked = begun.round, begun.total, begun.picked
            waited = time.perf_counter()
            contributions = begun.collect(book, private)
            waited = time.perf_counter() - waited
            if begun.trains:
                book.record(r, picked)
            sums = layer.aggregate(
                method.schema(state),
                contributions,
                silos=picked,
                noise=private,
                trained_from=state.content_digest(),
                records={u: np.bincount(silos[u].y, minlength=silos[u].num_classes) for u in picked},
            )
            state = method.server_step(state, sums, ServerContext(r, config.seed))
            begun = _begin(config, method, state, silos, private, book, backend)  # on Ray, trains meanwhile
            entry = recorder.evaluate(
                r,
                method.eval_model(state),
                clipped_values=sum(c.clipped for c in contributions),
                state_digest=state.digest(),
            )
            entry["seconds"], finished = round(time.perf_counter() - finished, 3), time.perf_counter()
            entry["train_seconds"] = round(waited, 3)  # waiting for the silos (on Ray, beyond the overlap)
            if config.selection.per_round:
                entry["participants"] = picked
            if config.selection.discloses:
                entry["coverage_error"] = _coverage_error(book, silos, config.selection.separation)
            if private:
                entry["epsilon_spent"] = max(p.ledger.spent() for p in private.values())
            recorder.append(entry)
            ledgers = {silo_id: p.ledger.entries for silo_id, p in private.items()}
            _save_checkpoint(out, config, state, recorder.rounds, book, layer.saved(), ledgers)
            echo(round_line(entry, total))
            if on_round is not None:
                on_round(r, total, entry)
    table = recorder.finish()
    return RunResult({**recorder.header, "rounds": recorder.rounds}, table, state)


@dataclass
class _Begun:
    """A round whose silo work has been handed to the backend: on Ray it runs while the driver evaluates and
    saves the round before; serially it runs when collected, as it always has."""

    round: int
    total: int
    trains: bool
    picked: list[str]
    disclosures: tuple[list[str], Callable[[], list[torch.Tensor]]] | None  # MFSC's, from every silo
    contributions: Callable[[], list[tuple[Contribution, PrivateRound | None]]]

    def collect(self, book: SelectionBook, private: dict) -> list[Contribution]:
        """The silos' contributions; their disclosures go into `book`, their DP sides into `private`."""
        if self.disclosures is not None:
            disclosing, results = self.disclosures
            book.disclosures.update(zip(disclosing, results(), strict=True))
        contributions = []
        for silo_id, (contribution, silo_private) in zip(self.picked, self.contributions(), strict=True):
            contributions.append(contribution)
            if silo_private is not None:  # its ledger and noise stream moved on where it trained
                private[silo_id] = silo_private
        return contributions


def _begin(
    config: SimConfig,
    method: Method,
    state: GlobalState,
    silos: dict[str, LabeledData],
    private: dict,
    book: SelectionBook,
    backend: Backend,
) -> _Begun | None:
    """The next round's silo work handed to the backend, or None when the method is done."""
    if method.remaining_rounds(state) <= 0:
        return None
    r, total = state.round + 1, state.round + method.remaining_rounds(state)
    trains = method.trains(state)
    picked = (
        choose_participants(config.selection, list(silos), r, config.seed, book) if trains else list(silos)
    )
    disclosures = None
    if trains and config.selection.discloses:  # every silo, so that all means share one encoder
        work = [(u, (simulated_mask_secret(config.seed, u), config.selection)) for u in silos]
        disclosures = list(silos), backend.submit(_disclose, method, state, work)
    work = [(u, SiloContext(r, u, config.seed, private.get(u))) for u in picked]
    return _Begun(r, total, trains, picked, disclosures, backend.submit(_train, method, state, work))


def _train(
    method: Method, state: GlobalState, silo: LabeledData, ctx: SiloContext
) -> tuple[Contribution, PrivateRound | None]:
    """A silo's local round, with its DP side as the round left it (a copy, where the silo ran elsewhere)."""
    return method.local_round(state, silo, ctx), ctx.private


def _disclose(
    method: Method, state: GlobalState, silo: LabeledData, arg: tuple[bytes, SelectionConfig]
) -> torch.Tensor:
    """MFSC's masked class means of one silo, under its (simulated) mask secret."""
    secret, selection = arg
    stream = mask_stream(secret, state.content_digest())
    return class_mean_disclosure(
        method, state, silo, selection.mask, stream, min_samples=selection.min_samples
    )


def make_method(
    config: SimConfig, input_shape: tuple[int, ...], num_classes: int, *, table: TableLayout | None = None
) -> Method:
    """The configured method for data of this shape (`table`: rows encoded by that layout); `model = "auto"`
    picks by image size, or `mlp` for table rows."""
    name = config.model.name if config.model.name != "auto" else default_model(input_shape)
    cls = method_class(config.method.name)
    spec = ModelSpec(name, input_shape, num_classes, options=config.model.options, table=table)
    return cls(
        options=config.method.options, train=config.train, model=spec, rounds=config.rounds, dp=config.dp
    )


def _silo_privacy(config: SimConfig, method: Method, silos: dict, saved: dict[str, list[dict]]) -> dict:
    """Each simulated silo's DP side with its own ledger, as the consortium's silos keep theirs on disk;
    restored from the checkpoint so a resumed run remembers what its silos spent."""
    if not config.dp.enabled:
        return {}
    made = {}
    for silo_id in silos:
        made[silo_id] = silo_privacy(config.dp, method=method, ledger=None)
        made[silo_id].ledger.restore(saved.get(silo_id, []))
    return made


def run_title(config: SimConfig) -> str:
    data = config.data
    return f"{config.method.name} on {data.dataset}, IF {data.imbalance:g}, α {data.alpha:g}"


def _dataset_facts(config: SimConfig, federation: Federation) -> dict:
    return {
        "name": config.data.dataset,
        "classes": list(federation.classes),
        "train_counts": federation.train_counts.tolist(),
        "test_counts": federation.test.class_counts().tolist(),
        "silo_sizes": [len(s) for s in federation.silos],
        "label_skew_tv": round(federation.label_skew, 4),
    }


def _coverage_error(book: SelectionBook, silos: dict, separation: float) -> float:
    """How often MFSC misjudges whether a silo holds a class, over the silos that have disclosed; only a
    simulator, which holds every silo's data, can score it."""
    estimate = estimate_coverage(book.disclosures, separation)
    wrong = total = 0
    for silo_id, holds in estimate.items():
        truth = torch.from_numpy(silos[silo_id].class_counts() > 0)
        wrong += int((holds != truth).sum())
        total += len(holds)
    return round(wrong / total, 4)


def _save_checkpoint(
    out: Path,
    config: SimConfig,
    state: GlobalState,
    rounds: list[dict],
    book: SelectionBook,
    layer: dict,
    ledgers: dict[str, list[dict]],
) -> None:
    checkpoint = {
        "fingerprint": config.fingerprint(),
        "round": state.round,
        "model": dict(state.model),
        "extra": dict(state.extra),
        "rounds": rounds,
        "selection": book.as_dict(),
        "layer": layer,
        "ledgers": json.dumps(ledgers),
    }
    atomic_write(out / CHECKPOINT, lambda fh: torch.save(checkpoint, fh))


def _resume(
    out: Path, config: SimConfig, method: Method
) -> tuple[GlobalState, list[dict], SelectionBook, dict, dict] | None:
    path = out / CHECKPOINT
    if not path.exists():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["fingerprint"] != config.fingerprint():
        raise RunFolderError(
            f"{out} holds a run with different settings (see {out / 'config.toml'}); "
            "choose another --out or pass --fresh to discard it"
        )
    state = GlobalState(saved["round"], saved["model"], saved["extra"])
    if method.trained_rounds(state) > config.rounds:
        raise RunFolderError(
            f"{out} already holds {method.trained_rounds(state)} training rounds, more than the "
            f"{config.rounds} asked for; ask for at least as many, choose another --out, or pass --fresh"
        )
    book = SelectionBook.from_dict(saved["selection"])
    return state, saved["rounds"], book, saved.get("layer", {}), json.loads(saved.get("ledgers", "{}"))
