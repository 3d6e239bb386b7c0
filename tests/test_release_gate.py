"""The release gate every silo release passes (issue 30): roster, floors, and a ledger keyed by what is
released, never by labels the aggregator chooses; ledgers that fail closed; writes that survive a power loss.

The attacks on the real protocol (two attempts relabelled, censuses relabelled) are in
tests/test_attacks_protocol.py and tests/test_silo_releases.py; here the gate's own rules, property-tested.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema
from fedlt.aggregation.gate import (
    Floors,
    GateRefusal,
    MemoryLedger,
    ReleaseGate,
    RepeatedRelease,
    Subject,
)
from fedlt.aggregation.halves import SiloHalf, SiloSide, SumSpec
from fedlt.aggregation.round_sums import RoundSums, SiloRound
from fedlt.atomic import atomic_write_text
from fedlt.methods.state import GlobalState
from silo.releases import LEDGER, LedgerMissing, ReleaseLedger, check_ledgers

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


def test_ledgers_fail_closed_when_the_state_shows_earlier_work(tmp_path):
    privacy = tmp_path / "privacy-ledger.json"
    check_ledgers(tmp_path, privacy)  # a new silo
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
