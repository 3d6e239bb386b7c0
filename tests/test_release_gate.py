"""The release gate every silo release passes (issue 30): roster, floors, and a ledger keyed by what is
released, never by labels the aggregator chooses; ledgers that fail closed; writes that survive a power loss.

The attacks on the real protocol (two attempts relabelled, censuses relabelled) are in
tests/test_attacks_protocol.py and tests/test_silo_releases.py; here the gate's own rules, property-tested.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema
from fedlt.aggregation.gate import (
    KEY_VERSION,
    Floors,
    GateRefusal,
    MemoryLedger,
    ReleaseGate,
    RepeatedRelease,
    Subject,
    data_digest,
)
from fedlt.aggregation.halves import Released, SiloHalf, SiloSide, SumAborted, SumSpec
from fedlt.aggregation.round_sums import AggregatorRound, RoundSums, SiloRound
from fedlt.aggregation.tail_guard import Census, CensusError
from fedlt.atomic import atomic_write_text
from fedlt.config import as_table, render_toml
from fedlt.data.federation import build_federation
from fedlt.data.source import Slice, embedded
from fedlt.methods.state import GlobalState
from privacy.blind.layer import BlindSum
from silo.admission import Prepared
from silo.config import load_silo_config
from silo.participation import Participation
from silo.releases import LEDGER, LedgerMissing, ReleaseLedger, check_ledgers
from tests.consortium_harness import PLAN, RECIPE
from tests.test_silo_releases import census_round

SILOS = tuple(f"silo-{k}" for k in range(6))
SCHEMA = Schema((Field("delta", (4,), 1.0),))


class Side(SiloSide):
    """A layer side with a minimum of its own (secagg: its threshold; ckks: none, 1) and no halves."""

    def __init__(self, minimum: int = 1, *, hides: bool = True, refuse: str = "") -> None:
        self.minimum, self.hides_inputs, self.refuse = minimum, hides, refuse

    def half(self, spec, me, *, may_release) -> SiloHalf:
        raise AssertionError("the gate refused, so no half is made")

    def problems(self, spec: SumSpec) -> list[str]:
        return [self.refuse] if self.refuse else []

    def min_counted(self, spec: SumSpec) -> int:
        return self.minimum


DEFAULT_FLOORS = Floors()


def gate(ledger=None, *, members=SILOS, floors=DEFAULT_FLOORS) -> ReleaseGate:
    return ReleaseGate(
        consortium="c", floors=floors, members=lambda: members, ledger=ledger or MemoryLedger()
    )


def spec(silos=SILOS[:3], purpose="contribution") -> SumSpec:
    return SumSpec("r1.a1", purpose, tuple(sorted(silos)), SCHEMA)


def test_admission_refuses_ghost_ids_too_few_silos_and_the_layers_own_refusals():
    with pytest.raises(GateRefusal, match="ghost, not silos of this silo's roster"):
        gate().admit(spec(("silo-0", "silo-1", "ghost")), Side())
    with pytest.raises(GateRefusal, match=r"lists 2 silos, fewer than policy\.min_participants 3"):
        gate().admit(spec(SILOS[:2]), Side())
    with pytest.raises(GateRefusal, match="threshold too low"):
        gate().admit(spec(), Side(refuse="threshold too low"))
    gate().admit(spec(SILOS[:2]), Side(hides=False))  # plaintext hides nothing: no floor to keep
    gate().admit(spec(), Side())


def test_a_release_counts_only_listed_members_and_at_least_the_floor():
    subject = Subject("contribution", b"state")
    with pytest.raises(GateRefusal, match="counts silos it does not list"):
        gate().release(spec(), Side(), ("silo-0", "silo-1", "silo-4"), subject)
    with pytest.raises(GateRefusal, match="counts silos it does not list"):
        gate().release(spec(), Side(), ("silo-0", "silo-0", "silo-1"), subject)
    with pytest.raises(GateRefusal, match="non-members"):
        gate(members=SILOS[1:]).release(spec(), Side(), SILOS[:3], subject)
    with pytest.raises(GateRefusal, match="would count 2 silos, fewer than the 3"):
        gate().release(spec(SILOS[:5]), Side(), SILOS[:2], subject)


@pytest.mark.parametrize(
    ("listed", "layer_minimum", "floor", "expected"),
    [
        (5, 1, 3, 3),  # ckks: no dropout recovery of its own, so the policy's floor, not every listed silo
        (10, 7, 3, 7),  # secagg: its threshold when that is higher
        (3, 1, 3, 3),
        (4, 1, 2, 2),
    ],
)
def test_dp_noise_is_calibrated_for_the_fewest_silos_a_release_may_count(
    listed, layer_minimum, floor, expected
):
    """Finding 4: calibrating for every listed silo leaves a sum after dropouts (or with ghost ids listed)
    short of its noise; the gate's minimum is what every release is held to, so the noise never is."""
    floors = Floors(participants=floor, survivors=floor)
    listing = spec(tuple(f"silo-{k:02d}" for k in range(listed)))
    assert gate(floors=floors).min_counted(listing, Side(layer_minimum)) == expected


def test_the_ledger_pins_one_survivor_set_per_subject_and_keys_only_by_what_is_released(tmp_path):
    ledger = ReleaseLedger(tmp_path)
    contribution = Subject("contribution", b"state-content")
    gate(ledger).release(spec(SILOS[:4]), Side(), SILOS[:3], contribution)
    gate(ledger).release(spec(SILOS[:4]), Side(), SILOS[:3], contribution)  # the same set again: the same sum
    with pytest.raises(RepeatedRelease, match="would let the aggregator subtract the two sums"):
        gate(ReleaseLedger(tmp_path)).release(spec(SILOS[:4]), Side(), SILOS[:4], contribution)  # restarted
    gate(ledger).release(spec(SILOS[:4]), Side(), SILOS[:4], Subject("contribution", b"another state"))
    gate(ledger).release(spec(SILOS[:4], "census"), Side(), SILOS[:4], None)  # a DP census: nothing to keep
    assert Subject("census", b"x").key("c") != Subject("contribution", b"x").key("c")
    assert Subject("census", b"x").key("c") != Subject("census", b"x").key("d")


@settings(max_examples=60, deadline=None)
@given(
    sets=st.lists(st.sets(st.sampled_from(SILOS), min_size=1, max_size=6), min_size=1, max_size=8),
    floor=st.integers(min_value=2, max_value=4),
)
def test_a_subject_is_released_to_exactly_one_set_of_enough_silos(sets, floor):
    """Property: over any sequence of survivor sets the aggregator offers, the gate releases a subject only
    to sets of at least the floor, and to one such set only (the first it accepted), whatever the order."""
    checked = gate(floors=Floors(participants=floor, survivors=floor))
    subject, accepted = Subject("contribution", b"s"), []
    for survivors in sets:
        try:
            checked.release(spec(SILOS), Side(), tuple(sorted(survivors)), subject)
            accepted.append(frozenset(survivors))
        except GateRefusal:
            continue
    assert all(len(s) >= floor for s in accepted)
    assert len(set(accepted)) <= 1
    big_enough = [frozenset(s) for s in sets if len(s) >= floor]
    expected = [s for s in big_enough if s == big_enough[0]] if big_enough else []
    assert accepted == expected


def test_a_state_relabelled_with_another_round_has_the_same_content():
    """The contribution's key is the state's content, which the round label the aggregator picks leaves
    alone; the signed digest, which binds the round too, changes."""
    model = {"w": torch.arange(4.0)}
    three, seven = GlobalState(3, model), GlobalState(7, model)
    assert three.content_digest() == seven.content_digest()
    assert three.digest() != seven.digest()
    assert GlobalState(3, {"w": torch.arange(4.0) + 1}).content_digest() != three.content_digest()


class Recorder:
    """A silo's DP noise that records what it was calibrated for."""

    def __init__(self) -> None:
        self.counted: list[int] = []

    def noised(self, spec: SumSpec, vector: torch.Tensor, *, counted: int) -> torch.Tensor:
        self.counted.append(counted)
        return vector


def silo_round(listed: tuple[str, ...], side: SiloSide, noise: Recorder | None = None) -> SiloRound:
    sums = RoundSums("r1.a1", listed, SCHEMA, k_min=2, census=None)
    return SiloRound(
        side,
        sums,
        torch.zeros(SCHEMA.size, dtype=torch.float64),
        me=listed[0],
        gate=gate(),
        trained_from=Subject("contribution", b"s"),
        noise=noise,
    )


def test_the_round_driver_admits_through_the_gate_before_any_noise_is_charged():
    """No half and no DP charge for a sum the gate refuses (ghost ids listed to inflate the count)."""
    noise = Recorder()
    with pytest.raises(GateRefusal, match="ghost"):
        silo_round(("ghost-1", "ghost-2", "silo-0"), Side(), noise).start()
    assert noise.counted == []


class HalfSide(Side):
    """A side whose half releases at once to whoever the test names."""

    def __init__(self, survivors: Callable[[SumSpec], tuple[str, ...]]) -> None:
        super().__init__()
        self.survivors = survivors

    def half(self, spec, me, *, may_release) -> SiloHalf:
        may_release(self.survivors(spec))
        raise AssertionError("released")


def test_a_layer_half_that_releases_to_too_few_is_stopped_by_the_gate():
    """Whatever a layer's half does, its release ends in the gate: a ckks-like half handed a sum of two
    (one silo dropped) is refused, so neither survivor reads the other's input."""
    noise = Recorder()
    side = HalfSide(lambda spec: spec.silos[:2])
    with pytest.raises(GateRefusal, match="would count 2 silos, fewer than the 3"):
        silo_round(SILOS[:3], side, noise).start()
    assert noise.counted == [3]


# --- the gate under blind, where every silo reads the sum -------------------------------------------------


def blind_sum(
    listed: tuple[str, ...], *, members=SILOS, floors=DEFAULT_FLOORS, leaves: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None], dict[str, str]]:
    """A blind round over `listed` through the real halves and round driver, each silo with its own gate
    (`members`: its roster, `floors`); silos in `leaves` stop after their first message (their keys). Each
    silo's input, the sum it read (None: none) and why each silo that left did."""
    sides, aggregator_side = BlindSum().in_process(listed)
    sums = RoundSums("r1.a1", listed, SCHEMA, k_min=2, census=None)
    inputs = {
        u: torch.rand(SCHEMA.size, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) - 0.5
        for k, u in enumerate(listed)
    }
    rounds = {
        u: SiloRound(
            sides[u],
            sums,
            inputs[u],
            me=u,
            gate=gate(members=members, floors=floors),
            trained_from=Subject("contribution", b"s"),
        )
        for u in listed
    }
    aggregator = AggregatorRound(aggregator_side, sums)
    refusals: dict[str, str] = {}

    def answer(silo: str, call: Callable[[], list]) -> list:
        if silo in refusals:
            return []
        try:
            return [(silo, purpose, message) for purpose, message in call()]
        except SumAborted as exc:  # the gate's refusals among them: the silo leaves the sum
            refusals[silo] = str(exc)
            return []

    inbox = [m for u, r in rounds.items() for m in answer(u, r.start)]
    refusals.update(dict.fromkeys(leaves, "left"))
    while inbox:
        for silo, purpose, message in inbox:
            aggregator.receive(silo, purpose, message)
        try:
            out = aggregator.close()
        except SumAborted:
            break
        if isinstance(out, Released):
            break
        inbox = [m for u, purpose, step in out for m in answer(u, partial(rounds[u].step, purpose, step))]
    return inputs, {u: r.result for u, r in rounds.items()}, refusals


def test_a_blind_sum_of_two_gives_each_silo_the_others_input_so_the_gate_refuses_it():
    """The attack: under blind every silo reads the sum, so in a sum of two the sum minus a silo's own input
    is the other's, the aggregator needing no colluder. It works where the floors allow two; the default
    floors refuse it before any message leaves."""
    pair = SILOS[:2]
    inputs, read, _ = blind_sum(pair, floors=Floors(participants=2, survivors=2))
    assert torch.allclose(read["silo-0"] - inputs["silo-0"], inputs["silo-1"], atol=1e-6)
    inputs, read, refusals = blind_sum(pair)
    assert read == dict.fromkeys(pair)
    for silo in pair:
        assert "lists 2 silos, fewer than policy.min_participants 3" in refusals[silo]


def test_a_blind_sum_of_ghosts_the_aggregator_plays_is_refused_by_the_roster():
    """The attack: the aggregator lists two ghosts beside silo-0 and silo-1 to meet the floor and plays them
    with a colluding silo's output key; silo-0 then reads the sum and, knowing the ghosts' inputs (made up by
    the aggregator, here all in the clear to the test), gets silo-1's. Against a gate that took every listed
    id for a member it works; against the roster both real silos refuse at admission."""
    listed = ("ghost-1", "ghost-2", "silo-0", "silo-1")
    inputs, read, _ = blind_sum(listed, members=listed)
    ghosts = inputs["ghost-1"] + inputs["ghost-2"]
    assert torch.allclose(read["silo-0"] - inputs["silo-0"] - ghosts, inputs["silo-1"], atol=1e-6)
    _, read, refusals = blind_sum(listed)
    assert read == dict.fromkeys(listed)
    for silo in ("silo-0", "silo-1"):
        assert "ghost-1, ghost-2, not silos of this silo's roster" in refusals[silo]


def test_a_blind_sum_left_with_fewer_survivors_than_a_silos_floor_is_read_by_no_silo():
    """Four listed, threshold 3: one silo leaves after its keys, and the sum goes on over three. Silos whose
    floor is three read it; silos whose policy wants four survivors refuse at the consistency step (where a
    blind silo releases its input), so none of them reads a sum over fewer."""
    listed = SILOS[:4]
    _, read, _ = blind_sum(listed, leaves=("silo-3",))
    assert all(read[u] is not None for u in listed[:3])
    _, read, refusals = blind_sum(listed, floors=Floors(participants=3, survivors=4), leaves=("silo-3",))
    assert read == dict.fromkeys(listed)
    for silo in listed[:3]:
        assert "would count 3 silos, fewer than the 4" in refusals[silo]


def test_ledgers_fail_closed_when_the_state_shows_earlier_work(tmp_path):
    privacy = tmp_path / "privacy-ledger.json"
    check_ledgers(tmp_path, privacy)  # a new silo: its empty book is made there and then
    assert (tmp_path / LEDGER).exists()
    (tmp_path / LEDGER).unlink()  # then lost, after the silo worked
    (tmp_path / "progress.json").write_text("{}")
    with pytest.raises(LedgerMissing, match=r"releases.json is missing, but this silo has worked before"):
        check_ledgers(tmp_path, privacy)
    ledger = ReleaseLedger(tmp_path)
    check_ledgers(tmp_path, privacy)  # a silo from before the privacy ledger was noted: nothing to miss
    privacy.write_text("{}")
    ledger.note_privacy_ledger()
    check_ledgers(tmp_path, privacy)
    privacy.unlink()
    with pytest.raises(LedgerMissing, match=r"privacy-ledger\.json is missing, but .*releases\.json records"):
        check_ledgers(tmp_path, privacy)
    (tmp_path / LEDGER).unlink()
    (tmp_path / "progress.json").unlink()
    (tmp_path / "roster.json").write_text("{}")  # a pinned roster is work too
    with pytest.raises(LedgerMissing, match=r"roster\.json"):
        check_ledgers(tmp_path, privacy)


def test_an_atomic_write_syncs_the_directory_after_the_rename(tmp_path, monkeypatch):
    """Finding 8a: a rename that is not synced can be undone by a power loss, and with it a ledger entry
    written "before the signature leaves"."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write_text(tmp_path / "ledger.json", "{}")
    assert synced == ["file", "dir"]


# --- one silo in several studies (issue 35): keys name the data, never the study -------------------------

FOUR, THREE = SILOS[:4], SILOS[:3]
STATE = GlobalState(1, {"w": torch.arange(4.0)}).content_digest().encode()  # one seeded initial model


def shard(index: int) -> Prepared:
    """Silo `index`'s shard of the tests' recipe, prepared as the tests' plan wants it, with its digests."""
    federation = build_federation(RECIPE, seed=0)
    source = embedded(federation.silos[index], federation.table)
    held_out = Slice(embedded(federation.test, federation.table), 0, 1)
    return Prepared.of(source.prepared(PLAN.wanted()), held_out.prepared(PLAN.wanted()))


def contribution(prepared: Prepared) -> Subject:
    """The key a study's contribution from STATE is released under (`silo.participation.Participation`)."""
    return Subject("contribution", STATE, prepared.data_digest)


def test_two_studies_over_the_same_data_from_the_same_state_release_over_one_silo_set_only(tmp_path):
    """(a) The attack: one silo's two studies over the same data start from the same seeded model, the first
    summed over three silos, the second over those and one more; the sums would subtract to the fourth's
    contribution. The second study's agent (its own ledger object on the silo's one ledger, its own
    preparation of the data) meets the first's key and refuses. Keys without the data (before this change)
    refused it too."""
    imaging, readmission = shard(0), shard(0)  # prepared by each study's agent on its own
    assert imaging.data_digest == readmission.data_digest
    gate(ReleaseLedger(tmp_path)).release(spec(FOUR), Side(), THREE, contribution(imaging))
    with pytest.raises(RepeatedRelease, match="would let the aggregator subtract the two sums"):
        gate(ReleaseLedger(tmp_path)).release(spec(FOUR), Side(), FOUR, contribution(readmission))


def test_two_studies_over_different_data_from_one_seeded_state_each_release(tmp_path):
    """(b) Two studies of one silo over different data (this year's and last year's) whose plans start from
    the same seeded model: their contributions differ, so neither sum subtracts to anything, and both are
    released, over different silo sets. Keyed by the state alone (before this change), the second was
    refused: the silo could not take part in both."""
    this_year, last_year = shard(0), shard(1)
    assert this_year.data_digest != last_year.data_digest
    gate(ReleaseLedger(tmp_path)).release(spec(FOUR), Side(), THREE, contribution(this_year))
    gate(ReleaseLedger(tmp_path)).release(spec(FOUR), Side(), FOUR, contribution(last_year))
    evaluated = [Subject("evaluation", STATE, p.held_out_digest) for p in (this_year, last_year)]
    assert evaluated[0].key("c") == evaluated[1].key("c")  # the same held-out data: one key, as it should


CLASSES = ("cat", "dog", "fox", "owl")
CENSUS_SCHEMA = Schema((Field("rows", (4, 2), 10.0, per_class=True),))
# the victim, silo-0, lacks the fox; every other silo holds every class, in both studies' data
HOLDS = {"silo-0": (0, 1, 3), "silo-1": (0, 1, 2, 3), "silo-2": (0, 1, 2, 3), "silo-3": (0, 1, 2, 3)}


def census_subject(silo: str) -> Subject:
    """What `silo`'s census is keyed by, as its round driver makes it."""
    rows = torch.zeros(4, 2, dtype=torch.float64)
    rows[list(HOLDS[silo])] = 1.0
    sums = RoundSums("r1.a1", FOUR, CENSUS_SCHEMA, k_min=2, census=None)
    return SiloRound(
        Side(),
        sums,
        rows.flatten(),
        me=silo,
        gate=gate(),
        trained_from=Subject("contribution", b"s"),
        class_names=CLASSES,
    ).census_subject


def census_sums(tmp_path, *, keyed_by_data: bool) -> list[np.ndarray | None]:
    """Study 1's census over all four silos, then study 2's over all but the victim, every silo with its
    own ledger and, in each study, its own data; the sums the aggregator reads (None: a silo refused)."""
    for silo in FOUR:
        (tmp_path / silo).mkdir(parents=True)
    ledgers = {silo: ReleaseLedger(tmp_path / silo) for silo in FOUR}
    sums: list[np.ndarray | None] = []
    for study, silos in ((1, FOUR), (2, FOUR[1:])):
        flags = []
        for silo in silos:
            subject = census_subject(silo)
            if keyed_by_data:
                subject = replace(subject, data=f"{silo}'s data of study {study}")
            try:
                gate(ledgers[silo]).release(spec(silos, "census"), Side(), silos, subject)
            except RepeatedRelease:
                sums.append(None)
                break
            flags.append(np.isin(np.arange(4), HOLDS[silo]).astype(np.int64))
        else:
            sums.append(np.sum(flags, axis=0))
    return sums


def test_a_census_keyed_by_its_data_would_give_one_silos_presence_to_two_studies_sums(tmp_path):
    """Why a census names no data. The attack: two studies over different data in which every silo holds the
    same classes; study 1's census over four silos, study 2's over the three that are not the victim. Were
    censuses keyed by the data (each silo's data differs between studies), every silo would release both,
    and the difference of the sums is the victim's presence: it lacks the fox. Keyed by the presence the
    census is, each of the three refuses to give its presence to a second silo set."""
    first, second = census_sums(tmp_path / "by-data", keyed_by_data=True)
    assert (first - second).tolist() == [1, 1, 0, 1]  # the victim's class presence, exactly
    first, second = census_sums(tmp_path / "by-presence", keyed_by_data=False)
    assert second is None


class Forgetful(ReleaseLedger):
    """An upgrade that forgot the pins an older agent made under version-2 keys."""

    def v2_pin(self, key: str) -> list[str] | None:
        return None


def test_a_pin_made_before_keys_named_the_data_still_refuses_a_second_release(tmp_path):
    """(c) The attack on the upgrade: a silo released a contribution over three silos before this change (its
    ledger holds the version-2 key, without the data); after the upgrade the aggregator asks for it again
    over four. The version-3 key is new, so an upgrade that forgot the old pins releases it; the gate meets
    the old key too and refuses, for as long as the ledger holds it."""
    subject = contribution(shard(0))
    older = {"survivors": {subject.v2_key("c"): list(THREE)}, "censuses": {}, "disclosure": {}}
    (tmp_path / LEDGER).write_text(json.dumps(older))  # as an agent before this change left it
    attacked = tmp_path / "attacked"
    attacked.mkdir()
    (attacked / LEDGER).write_text(json.dumps(older))
    gate(Forgetful(attacked)).release(spec(FOUR), Side(), FOUR, subject)  # the attack works on the forgetful
    with pytest.raises(RepeatedRelease, match=r"silo-0, silo-1, silo-2 \(recorded before this version"):
        gate(ReleaseLedger(tmp_path)).release(spec(FOUR), Side(), FOUR, subject)
    # the same set, in whatever order the sum lists it: the same sum
    gate(ReleaseLedger(tmp_path)).release(spec(FOUR), Side(), tuple(reversed(THREE)), subject)
    book = json.loads((tmp_path / LEDGER).read_text())
    assert book["keys"] == KEY_VERSION
    assert book["v2"] == [subject.v2_key("c")]  # noted once; no version-2 key is pinned any more
    assert book["survivors"][subject.key("c")] == list(THREE)


def test_a_census_kept_before_censuses_were_marked_is_taken_anew_by_a_round_without_dp(tmp_path):
    """A census kept before the silo marked the ones it checked (here under its version-2 key) may have been
    taken under DP or on the aggregator's word under plaintext (finding 1 of issue 35's review), so it is
    kept as unchecked: a round that hides inputs without DP finds it and refuses it, as it refuses other
    counts; once the census is taken anew over the same silos (which the old pin allows), the round takes
    that one and no other."""
    census = Census.of(["a", "b", "c"], [3, 1, 2])
    presence = Subject("census", np.array([1, 0, 1], dtype="<u8").tobytes())  # "a" holds classes 0, 2
    key = presence.v2_key("c")
    older = {
        "survivors": {key: ["a", "b", "c"]},
        "censuses": {key: {"silos": ["a", "b", "c"], "counts": [3, 1, 2], "records": []}},
        "disclosure": {},
    }
    (tmp_path / LEDGER).write_text(json.dumps(older))
    ledger = ReleaseLedger(tmp_path)
    assert (ledger.census(key), ledger.unchecked_census(key)) == (None, census)
    with pytest.raises(CensusError, match="kept without checking it"):
        census_round(tmp_path, census, holds=[0, 2])
    with pytest.raises(CensusError, match="signed for but never computed"):
        census_round(tmp_path, Census.of(["a", "b", "c"], [3, 2, 2]), holds=[0, 2])
    gate(ledger, members=("a", "b", "c")).release(
        SumSpec("r1.a1", "census", ("a", "b", "c"), SCHEMA), Side(), ("a", "b", "c"), presence
    )
    ledger.record_census(presence.key("c"), census)  # computed when the census was taken again
    census_round(tmp_path, census, holds=[0, 2])
    with pytest.raises(CensusError, match="differs from the census this silo took part in"):
        census_round(tmp_path, Census.of(["a", "b", "c"], [3, 2, 2]), holds=[0, 2])


def study_round(tmp_path, census: Census, *, dp: bool) -> Participation:
    """Silo "a"'s part in a round of a study under secagg, with DP or without, whose RoundSpec names
    `census`, as its agent makes it: with the plan's class names, on the silo's one release ledger."""
    noise = Recorder() if dp else None  # "a" holds the cat and the fox
    return census_round(
        tmp_path, census, holds=[0, 2], members="abc", noise=noise, class_names=("cat", "dog", "fox")
    )


def test_a_study_under_dp_and_one_without_over_the_same_data_each_keep_their_census(tmp_path):
    """Both studies' censuses are kept, apart (finding 1 of issue 35's review): the one the study without
    DP computed (the dog held by one silo) and the one the study under DP names (every class by every silo,
    what a census under DP reads), neither replacing the other. Each study's rounds take their own; the
    study without DP refuses the DP study's census, which would lift its tail guard."""
    computed, under_dp = Census.of("abc", [3, 1, 2]), Census.of("abc", [3, 3, 3])
    presence = Subject("census", json.dumps(["cat", "fox"]).encode())
    ReleaseLedger(tmp_path).record_census(presence.key("c"), computed)  # the study without DP took it
    for _ in range(2):
        study_round(tmp_path, under_dp, dp=True)  # plausible under DP: kept, as unchecked
        study_round(tmp_path, computed, dp=False)
    study_round(tmp_path, computed, dp=True)  # a study under DP may guard with a checked census too
    with pytest.raises(CensusError, match="differs from the census this silo took part in"):
        study_round(tmp_path, under_dp, dp=False)
    ledger = ReleaseLedger(tmp_path)
    assert (ledger.census(presence.key("c")), ledger.unchecked_census(presence.key("c"))) == (
        computed,
        under_dp,
    )


STUDY_IDS = st.lists(
    st.from_regex(r"[a-z0-9][a-z0-9-]{0,39}", fullmatch=True), min_size=1, max_size=3, unique=True
)


@settings(max_examples=20, deadline=None)
@given(labels=STUDY_IDS)
def test_the_study_label_changes_nothing_in_any_key(labels):
    """(d) Property: whatever a silo's studies are called, each study's agent prepares the same data to the
    same digests, and so releases under the same keys, as the silo without studies: the label only routes
    calls, and the aggregator may put any label on any study."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "silo.toml"
        data = {"source": "embedded", "index": 0, "recipe": as_table(RECIPE)}
        path.write_text(render_toml({"data": data, "study": {label: {} for label in labels}}))
        config = load_silo_config(path)
        alone = replace(config, studies=())
        keys = {prepared_keys(alone)}
        keys |= {prepared_keys(config.for_study(label)) for label in labels}
        assert len(keys) == 1


def prepared_keys(config) -> tuple[str, ...]:
    """The keys a contribution and an evaluation from STATE are released under, by `config`'s agent."""
    wanted = PLAN.wanted()
    prepared = Prepared.of(config.load_data().prepared(wanted), config.load_evaluation().prepared(wanted))
    kinds = (("contribution", prepared.data_digest), ("evaluation", prepared.held_out_digest))
    return tuple(Subject(kind, STATE, digest).key("c") for kind, digest in kinds)


def test_a_data_digest_names_the_arrays_values_dtype_and_shape_whatever_their_memory_layout():
    """Found by a consortium run: a silo whose held-out slice is empty stopped at its first round."""
    samples = np.arange(12, dtype=np.float32).reshape(3, 4)
    labels = np.array([0, 1, 1])
    assert data_digest(samples, labels) == data_digest(np.asfortranarray(samples), labels)
    assert data_digest(samples, labels) != data_digest(samples.reshape(4, 3), labels)
    assert data_digest(samples, labels) != data_digest(samples.astype(np.float64), labels)
    assert data_digest(samples, labels) != data_digest(samples, labels[::-1])
    empty = data_digest(np.zeros((0, 1, 8, 8), dtype=np.float32), np.zeros(0, dtype=np.int64))
    assert empty != data_digest(np.zeros((0, 1, 4, 4), dtype=np.float32), np.zeros(0, dtype=np.int64))
