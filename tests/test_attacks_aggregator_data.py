"""Auditing a real aggregator's database: stores built with the aggregator's own `Store`, as its round driver
fills them, then audited from their folder.

Three silos run one RedGrape round on digits: silo-0 holds one record of class 3, silo-2 alone holds class 4,
classes 0–2 are held by two or three silos. Summed in the clear, every held class's prototype is released
(classes 3 and 4 by one silo each); summed under secagg's tail guard (k_min 2), classes 3 and 4 are zeroed.
The round also stores MFSC disclosures of the silos' masked class means on the model they received.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aggregator.config import load_consortium_config
from aggregator.held_state import SEALED
from aggregator.store import DATABASE, Retention, Store
from attacks.aggregator_data import (
    AggregatorDataError,
    _rounds,
    audit_aggregator_data,
    audit_stored,
    describe_store,
    read_aggregator_data,
    released_class_features,
)
from attacks.analytic import relative_error
from attacks.config import Thresholds, load_audit_config
from attacks.evaluate import DEFAULT_CONFIG, main
from fedlt.aggregation import tail_guard
from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.aggregation.sums import SumLayer
from fedlt.data.arrays import LabeledData
from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.methods import ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.heads import extract_features
from fedlt.methods.redgrape import RedGrape, RedGrapeOptions
from fedlt.methods.state import GlobalState, pack_state
from fedlt.selection import (
    DISCLOSURE,
    SelectionConfig,
    mask_stream,
    masked_class_means,
    simulated_mask_secret,
)
from privacy.secagg.layer import SecAggSum
from tests.consortium_harness import AUDIT_KEY

CLASSES = 10
HOLDINGS = {  # silo -> {class: records}
    "silo-0": {0: 8, 1: 8, 3: 1},
    "silo-1": {0: 8, 1: 8, 2: 6},
    "silo-2": {0: 8, 2: 8, 4: 8},
}
SILOS = sorted(HOLDINGS)
THRESHOLDS = Thresholds()


class World:
    """The round's silo data, the initial state they trained from, the next state under each layer."""

    def __init__(self) -> None:
        train, self.public = split_balanced_test(load_embedded("digits"), per_class=30, seed=0)
        self.method = RedGrape(
            options=RedGrapeOptions(),
            train=TrainConfig(local_epochs=1, batch_size=8, lr=0.05),
            model=ModelSpec("cnn-small", (1, 8, 8), CLASSES),
            rounds=2,
        )
        self.initial = self.method.init_state(seed=0)
        self.silos = {}
        for k, (silo, counts) in enumerate(HOLDINGS.items()):
            rows = [i for c, n in counts.items() for i in np.flatnonzero(train.y == c)[10 * k : 10 * k + n]]
            self.silos[silo] = LabeledData(train.x[rows], train.y[rows], train.classes)
        self.contributions = [
            self.method.local_round(self.initial, self.silos[s], SiloContext(1, s, 0)) for s in SILOS
        ]

    def features(self, silo: str, label: int) -> torch.Tensor:
        """The features of `silo`'s records of `label` under the model the round's gradients were taken on."""
        data = self.silos[silo]
        model = self.method.load(self.initial.model)
        return extract_features(model, torch.from_numpy(data.x[data.y == label]))

    def next_state(self, layer: SumLayer) -> GlobalState:
        sums = layer.aggregate(self.method.schema(self.initial), self.contributions, silos=SILOS)
        return self.method.server_step(self.initial, sums, ServerContext(1, 0))

    def disclosures(self, *, identical: bool = False) -> dict[str, tuple[str, bytes]]:
        """Each silo's MFSC disclosure as `class_mean_disclosure` computes it; `identical`: silo-0's, masks
        included, from every silo."""
        model = self.method.load(self.initial.model)
        out = {}
        for silo in SILOS:
            source = SILOS[0] if identical else silo
            data = self.silos[source]
            means = masked_class_means(
                extract_features(model, torch.from_numpy(data.x)),
                torch.from_numpy(data.y),
                CLASSES,
                "gaussian",
                mask_stream(simulated_mask_secret(0, source), "round-1"),
                min_samples=SelectionConfig.min_samples,
            )
            out[silo] = (DISCLOSURE, means.numpy().astype("<f8").tobytes())
        return out


def build_store(
    folder: Path,
    world: World,
    state: GlobalState,
    *,
    guard: SumLayer | None = None,
    disclosures: dict[str, tuple[str, bytes]] | None = None,
) -> Path:
    """An aggregator's database after its first round, written as `RoundDriver` writes it: initial state,
    attempt, the census and tail-guard record of a guarded sum, then the commit with its disclosures."""
    store = Store(folder / DATABASE, audit_key=AUDIT_KEY)
    store.save_initial_state(world.initial.digest(), pack_state(world.initial))
    _, round_id = store.begin_attempt(1, SILOS, "0000")
    if guard is not None:
        (census,) = guard.censuses.values()
        store.save_census(tail_guard.phase_key("c", "plan", 0, "train"), census)
        store.audit("tail_guard", {"round_id": round_id, "k_min": guard.k_min, "zeroed": guard.zeroed})
    store.commit_round(
        round_number=1,
        round_id=round_id,
        digest=state.digest(),
        data=pack_state(state),
        contributors=SILOS,
        disclosures=disclosures,
    )
    store.close()
    return folder


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def world() -> World:
    return World()


@pytest.fixture(scope="module")
def plaintext(world, tmp_path_factory) -> Path:
    state = world.next_state(PlaintextSum())
    return build_store(tmp_path_factory.mktemp("plaintext"), world, state, disclosures=world.disclosures())


@pytest.fixture(scope="module")
def guarded(world, tmp_path_factory) -> Path:
    layer = SecAggSum()
    state = world.next_state(layer)
    assert layer.k_min == 2
    assert layer.zeroed == [3, 4]  # the premise: the guard held back the classes one silo holds
    return build_store(tmp_path_factory.mktemp("guarded"), world, state, guard=layer)


def test_a_class_one_silo_held_gives_its_record_feature_and_is_flagged(world, plaintext):
    """Guards attack (a) on the stored prototypes: silo-0's one class-3 record comes back to float precision,
    and the unguarded round is a leak."""
    state = read_aggregator_data(plaintext).rounds[1].state
    features = released_class_features(state)
    assert sorted(features) == [0, 1, 2, 3, 4]  # every held class, none of the others
    (record,) = world.features("silo-0", 3)
    assert relative_error(features[3], record) < 1e-6
    # a class of several records gives a weighted mean, not one of them
    assert min(relative_error(features[4], z) for z in world.features("silo-2", 4)) > 1e-3

    (finding,) = [
        f for f in audit_aggregator_data(plaintext, thresholds=THRESHOLDS) if f.attack == "analytic"
    ]
    assert finding.leaked
    assert finding.audited
    assert finding.mode == f"deployment: {plaintext.name}"
    assert finding.target.startswith("round 1:")
    assert finding.metrics["classes_released"] == 5
    assert finding.metrics["classes_withheld"] == 5
    assert finding.metrics["holders_at_least"] == 1
    assert "no tail guard" in finding.note
    assert finding.images == {}
    assert finding.note.endswith("no images: no public data given")


def test_classes_the_tail_guard_zeroed_are_withheld_and_not_a_leak(guarded):
    """Guards the other direction: the same holdings under the guard release only classes of 2+ silos."""
    features = released_class_features(read_aggregator_data(guarded).rounds[1].state)
    assert sorted(features) == [0, 1, 2]
    finding, census = audit_aggregator_data(guarded, thresholds=THRESHOLDS)
    assert (finding.attack, census.attack) == ("analytic", "protocol: presence intersection")
    assert not census.leaked  # the one census the store keeps pins only what its own counts say
    assert not finding.leaked
    assert finding.metrics["classes_released"] == 3
    assert finding.metrics["holders_at_least"] == 2
    assert "zeroed [3, 4]" in finding.note


def test_with_public_data_recovered_features_are_decoded_and_disclosures_scored(world, plaintext):
    """Guards the decoded images (recovered only: no originals exist) and the presence finding, whose calls
    nobody can check without the silos' holdings."""
    labels: list[str] = []
    findings = audit_aggregator_data(
        plaintext, thresholds=THRESHOLDS, public=world.public, progress=labels.append
    )
    analytic, presence = findings
    assert set(analytic.images) == {"recovered"}
    images = analytic.images["recovered"]
    assert images.shape == (5, 1, 8, 8)
    assert images.min() >= 0.0
    assert images.max() <= 1.0
    assert presence.attack == "presence"
    assert presence.metrics["silos"] == 3
    for detector in ("margin", "norm", "clustering"):
        assert 0.0 <= presence.metrics[f"{detector}_called_real"] <= 1.0
    assert "ground truth is unknown" in presence.note
    # the silos hold different classes, and some detector tells them apart within a class
    assert presence.leaked
    assert any(presence.metrics[f"{d}_classes_split"] > 0 for d in ("margin", "norm", "clustering"))
    assert any("MFSC" in label for label in labels)


def test_presence_is_scored_against_holdings_the_operator_gives(world, tmp_path):
    """Guards both directions of the scored case: disclosures that differ by silo reveal presence (the cosine
    detector separates them on this encoder); identical disclosures reveal nothing per silo."""
    holdings = {s: [c for c, n in HOLDINGS[s].items() if n >= SelectionConfig.min_samples] for s in SILOS}
    plain = GlobalState(1, world.initial.model)  # a FedAvg round: no prototypes, no decoder to train
    distinct = build_store(tmp_path / "distinct", world, plain, disclosures=world.disclosures())
    (finding,) = audit_aggregator_data(
        distinct, thresholds=THRESHOLDS, public=world.public, holdings=holdings
    )
    assert finding.metrics["best_detector_within_class_auc"] > THRESHOLDS.presence_auc
    assert finding.leaked

    same = build_store(tmp_path / "same", world, plain, disclosures=world.disclosures(identical=True))
    (finding,) = audit_aggregator_data(same, thresholds=THRESHOLDS, public=world.public, holdings=holdings)
    assert finding.metrics["best_detector_within_class_auc"] == 0.5
    assert not finding.leaked
    partial = {s: holdings[s] for s in SILOS[:2]}
    with pytest.raises(AggregatorDataError, match=r"no classes for the disclosing silos \['silo-2'\]"):
        audit_aggregator_data(same, thresholds=THRESHOLDS, public=world.public, holdings=partial)
    (unscored,) = audit_aggregator_data(same, thresholds=THRESHOLDS, public=world.public)
    assert not unscored.leaked
    assert all(unscored.metrics[f"{d}_classes_split"] == 0 for d in ("margin", "norm", "clustering"))


def test_disclosures_without_public_data_are_reported_not_scored_and_do_not_pass(plaintext):
    """Guards 'missing is not zero': per-silo class means the audit could not score fail it, with the
    reason, instead of passing as if they had been found harmless."""
    (presence,) = [
        f for f in audit_aggregator_data(plaintext, thresholds=THRESHOLDS) if f.attack == "presence"
    ]
    assert presence.leaked
    assert presence.audited
    assert presence.note.startswith("stored, not scored (no public data given)")


def test_the_database_is_only_read(world, tmp_path):
    """Guards read-only access: a stopped aggregator's folder is left exactly as it was (no -wal or -shm of
    the auditing user beside the database), and a running one's store keeps working while it is read."""
    state = world.next_state(PlaintextSum())
    plaintext = build_store(tmp_path, world, state, disclosures=world.disclosures())
    path = plaintext / DATABASE
    listing = sorted(p.name for p in plaintext.iterdir())
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    audit_aggregator_data(plaintext, thresholds=THRESHOLDS)
    assert sorted(p.name for p in plaintext.iterdir()) == listing == [DATABASE]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    store = Store(path, audit_key=AUDIT_KEY)
    try:
        assert len(audit_aggregator_data(plaintext, thresholds=THRESHOLDS)) == 2
        store.audit("still_writable", {})
        store.verify_audit()
    finally:
        store.close()
    assert hashlib.sha256(path.read_bytes()).hexdigest() != before  # the store's own write, not the audit's


def census_store(folder: Path, world: World, censuses: dict[str, tuple[tuple[str, ...], list[int]]]) -> Path:
    """A FedAvg store after one round that keeps `censuses` (phase -> silos, holders of each class)."""
    build_store(folder, world, GlobalState(1, world.initial.model))
    store = Store(folder / DATABASE, audit_key=AUDIT_KEY)
    for phase, (silos, counts) in censuses.items():
        store.save_census(phase, tail_guard.Census.of(silos, counts))
    store.close()
    return folder


def test_censuses_over_different_silos_give_presence_away_and_the_store_audit_says_so(world, tmp_path):
    """Guards the presence intersection on what a store keeps (issue 36): a census of each phase over
    different sets of silos (silo-2 left out of the second) pins silo-2's every class, which neither census
    alone does; censuses over one set (what the release gate lets silos release) pin nothing more."""
    first = (("silo-0", "silo-1", "silo-2"), [3, 2, 1, 0])
    split = census_store(
        tmp_path / "split", world, {"train": first, "close": (("silo-0", "silo-1"), [2, 1, 1, 0])}
    )
    (finding,) = audit_aggregator_data(split, thresholds=THRESHOLDS)
    assert finding.attack == "protocol: presence intersection"
    assert finding.leaked
    assert finding.audited
    # classes 1 and 2 of all three silos were open; the two sums pin silo-2's bits (1 and 0) and nothing else
    assert finding.metrics["bits_beyond_census"] == pytest.approx(2 / 12)
    same = census_store(tmp_path / "same", world, {"train": first, "close": first})
    (finding,) = audit_aggregator_data(same, thresholds=THRESHOLDS)
    assert not finding.leaked
    assert finding.metrics["bits_beyond_census"] == 0


def test_a_folder_without_an_aggregator_database_is_a_clear_error(tmp_path):
    with pytest.raises(AggregatorDataError, match="no aggregator database"):
        audit_aggregator_data(tmp_path / "nowhere", thresholds=THRESHOLDS)
    (tmp_path / "other.sqlite").write_bytes(b"")
    with pytest.raises(AggregatorDataError, match="no aggregator database"):
        audit_aggregator_data(tmp_path, thresholds=THRESHOLDS)


def test_a_database_of_another_format_is_a_clear_error(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / DATABASE).write_text("not a database at all, but long enough to be read as one" * 20)
    with pytest.raises(AggregatorDataError, match="not an aggregator database"):
        audit_aggregator_data(tmp_path / "text", thresholds=THRESHOLDS)
    (tmp_path / "sqlite").mkdir()
    other = sqlite3.connect(tmp_path / "sqlite" / DATABASE)
    other.execute("CREATE TABLE states (x INTEGER)")
    other.close()
    with pytest.raises(AggregatorDataError, match="not an aggregator database: no table attempts, audit"):
        audit_aggregator_data(tmp_path / "sqlite", thresholds=THRESHOLDS)


def test_a_store_without_a_committed_round_is_a_clear_error(world, tmp_path):
    store = Store(tmp_path / DATABASE, audit_key=AUDIT_KEY)
    with pytest.raises(AggregatorDataError, match="no committed round"):
        audit_aggregator_data(tmp_path, thresholds=THRESHOLDS)
    store.save_initial_state(world.initial.digest(), pack_state(world.initial))  # round 0 releases nothing
    with pytest.raises(AggregatorDataError, match="no committed round"):
        audit_aggregator_data(tmp_path, thresholds=THRESHOLDS)
    store.close()


CONSORTIUM_TOML = """
[consortium]
id = "clinics"
rounds = 5
privacy = "secagg"

[server]
data_dir = "aggregator-data"

[model]
name = "cnn-small"
image_shape = [1, 8, 8]
classes = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]

[method]
name = "fedavg"
"""


def fedavg_deployment(world: World, directory: Path) -> Path:
    """A FedAvg consortium under secagg after one round, laid out as `aggregator serve` leaves it: its
    consortium.toml beside the data folder, whose store is bound to that file's settings."""
    directory.mkdir()
    (directory / "consortium.toml").write_text(CONSORTIUM_TOML)
    folder = build_store(directory / "aggregator-data", world, GlobalState(1, world.initial.model))
    store = Store(folder / DATABASE, audit_key=AUDIT_KEY)
    store.bind(load_consortium_config(directory / "consortium.toml").fingerprint())
    store.close()
    return folder


def test_a_store_no_attack_applies_to_is_nothing_audited_not_passed(world, tmp_path, capsys):
    """Guards 'an audit that ran nothing is not PASSED' (issue 31): FedAvg under secagg keeps states without
    per-class statistics and no disclosures, so no attack runs; the verdict says so, why, and exits 3, and
    the report describes the consortium's store, not the default grid's data."""
    folder = fedavg_deployment(world, tmp_path / "clinics")
    out = tmp_path / "report"
    assert main(["--aggregator-data", str(folder), "--out", str(out)]) == 3
    printed = capsys.readouterr().out
    assert "NOTHING AUDITED — no attack applies to what this store holds:" in printed
    assert "PASSED" not in printed
    assert "no per-class head gradients" in printed
    assert "no MFSC disclosures" in printed
    report = (out / "report.md").read_text()
    title, _, body = report.partition("\n")
    assert title == "# Privacy audit: NOTHING AUDITED"
    for fact in ("'clinics'", "fedavg", "secagg", "1 of 5 rounds", str(folder.resolve() / DATABASE)):
        assert fact in body
    grid = load_audit_config(DEFAULT_CONFIG)
    assert grid.data.dataset not in body
    assert f"IF {grid.data.imbalance:g}" not in body
    summary = json.loads((out / "report.json").read_text())
    assert summary["verdict"] == "nothing audited"
    assert not summary["passed"]
    assert summary["deployment"]["consortium"] == "clinics"
    assert "config" not in summary  # the default grid's settings describe nothing audited here
    assert summary["thresholds"] == dataclasses.asdict(grid.thresholds)


def test_sealed_and_blanked_states_are_named_as_why_nothing_was_audited(world, tmp_path):
    """Guards the reason's other branches: under ckks the silos seal every state, and [retention] blanks
    old ones; neither is attackable, and the verdict says which rounds are which."""
    store = Store(tmp_path / DATABASE, audit_key=AUDIT_KEY, retention=Retention(last=2))
    store.save_initial_state(world.initial.digest(), pack_state(world.initial))
    for number in (1, 2, 3):
        _, round_id = store.begin_attempt(number, SILOS, "0000")
        data = SEALED + bytes(8) if number < 3 else pack_state(GlobalState(number, world.initial.model))
        store.commit_round(round_number=number, round_id=round_id, digest="d", data=data, contributors=SILOS)
    store.close()
    data = read_aggregator_data(tmp_path)
    assert audit_stored(data, thresholds=THRESHOLDS) == []
    subject = describe_store(data)
    assert subject.nothing_applies == (
        "no per-class head gradients in the state of round 3 it keeps in the clear (RedGrape's prototypes "
        "are the only released statistic a state keeps); the state of round 2: sealed by the silos (ckks); "
        "the state of round 1: blanked by [retention]; it holds no MFSC disclosures (the presence attack's "
        "input); it holds no census (the presence intersection's input); the released sums and the silos' "
        "contributions are never stored"
    )
    assert "no consortium.toml beside the data folder" in subject.header
    assert "3 rounds committed" in subject.header


def test_a_consortium_toml_is_used_only_for_the_store_it_ran(world, plaintext, tmp_path, capsys):
    """Guards the header's source: settings given for another store are refused (exit 2, no report); a
    store whose audit finds leaks still names itself and fails (exit 1); a guarded one passes (exit 0)."""
    settings = fedavg_deployment(world, tmp_path / "clinics").parent / "consortium.toml"
    out = tmp_path / "report"
    assert main(["--aggregator-data", str(plaintext), "--consortium", str(settings), "--out", str(out)]) == 2
    assert "holds other settings than the ones" in capsys.readouterr().err
    assert not out.exists()

    assert main(["--aggregator-data", str(plaintext), "--out", str(out)]) == 1
    assert "audit FAILED" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert report.startswith("# Privacy audit: FAILED\n")
    assert f"the aggregator's store {plaintext.resolve() / DATABASE}" in report
    assert "pass --consortium" in report

    copy = tmp_path / "copied" / "aggregator-data"
    copy.mkdir(parents=True)
    (copy / DATABASE).write_bytes((settings.parent / "aggregator-data" / DATABASE).read_bytes())
    assert main(["--aggregator-data", str(copy), "--consortium", str(settings), "--out", str(out)]) == 3
    assert "Consortium 'clinics': method fedavg" in (out / "report.md").read_text()


def test_a_guarded_store_passes(guarded, tmp_path, capsys):
    assert main(["--aggregator-data", str(guarded), "--out", str(tmp_path / "report")]) == 0
    assert "audit passed" in capsys.readouterr().out
    assert json.loads((tmp_path / "report" / "report.json").read_text())["verdict"] == "passed"


@given(st.sets(st.integers(min_value=1, max_value=200), min_size=1))
def test_round_numbers_are_named_in_runs_that_give_them_back(numbers):
    """Guards the header's round lists: every run 'a–b' or 'a' expands back to exactly the rounds named."""
    text = _rounds(sorted(numbers))
    noun, _, spans = text.partition(" ")
    assert noun == ("round" if len(numbers) == 1 else "rounds")
    named = set()
    for span in spans.split(", "):
        first, _, last = span.partition("–")
        named |= set(range(int(first), int(last or first) + 1))
        assert not last or int(last) > int(first)
    assert named == numbers
