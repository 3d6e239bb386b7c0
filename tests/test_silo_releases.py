"""One release per round: two attempts of a round must not subtract to one silo's contribution.

A silo's contribution depends only on the round, so every attempt carries the same vector. The attack: run
round r over {a, b, c}, learn the sum, abort instead of committing, and run it again over {a, b, c, v}; the
difference is v's contribution, with no colluder at all. It is mounted here with the real round driver and
the silos' own `Participation`, first against silos that forget what they signed (it works), then against
silos that keep their ledger (it does not).
"""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest
import torch

from aggregator.config import ConsortiumConfig, ConsortiumSection, TimeoutSection
from aggregator.rounds import RoundDriver
from aggregator.store import Store
from fedlt.aggregation import Field, Schema, Sums
from fedlt.aggregation.gate import KEY_VERSION, Floors, ReleaseGate, Subject
from fedlt.aggregation.halves import PartyKeys, SumAborted
from fedlt.aggregation.tail_guard import Census, CensusError
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from privacy import roundspec
from privacy.secagg.layer import SecAggSum
from privacy.secagg.settings import SessionPolicy
from silo import releases
from silo.participation import Participation
from silo.releases import LEDGER, LedgerMissing, ReleaseLedger, RepeatedRelease
from tests.consortium_harness import AUDIT_KEY, PLAN
from tests.engine_harness import InProcessSilo, peers_of

FIRST, LATE = ["a", "b", "c"], "v"


def test_the_ledger_allows_one_survivor_set_per_release_and_remembers_it_across_restarts(tmp_path):
    ledger = ReleaseLedger(tmp_path)
    ledger.pin_survivors("round/1", ["b", "a", "c"], "contribution of round 1")
    ledger.pin_survivors("round/1", ["a", "b", "c"], "contribution of round 1")  # the same set again
    ledger.pin_survivors("round/2", ["a", "b"], "contribution of round 2")
    with pytest.raises(RepeatedRelease, match="already signed the contribution of round 1 for a, b, c"):
        ReleaseLedger(tmp_path).pin_survivors("round/1", ["a", "b", "c", "v"], "contribution of round 1")
    census = Census.of(["a", "b", "c"], [3, 1])
    ledger.record_census("phase", census)
    assert ReleaseLedger(tmp_path).census("phase") == census
    assert ReleaseLedger(tmp_path).census("other") is None
    ledger.record_disclosure("state/3", b"means")
    assert ReleaseLedger(tmp_path).disclosure("state/3") == b"means"
    assert ReleaseLedger(tmp_path).disclosure("state/4") is None


def values_of(silo: str):
    """Each silo's contribution to a round: the same in every attempt, as a deterministic training gives."""
    seed = {"a": 1, "b": 2, "c": 3, "v": 4}[silo]

    def values(schema, round_number):
        generator = torch.Generator().manual_seed(100 * round_number + seed)
        delta = torch.rand(schema.fields[0].shape, generator=generator, dtype=torch.float64) - 0.5
        return {"delta": delta, "n": torch.tensor(float(seed), dtype=torch.float64)}

    return values


class Subtraction:
    """A malicious aggregator: the first attempt of round 1 is summed and then aborted, not committed."""

    def __init__(self, tmp_path, *, forgetful: bool) -> None:
        self.forgetful = forgetful
        config = ConsortiumConfig(
            consortium=ConsortiumSection(rounds=1, min_silos=3),
            timeouts=TimeoutSection(gather=2.0, round=60.0, stage=3.0),
            plan=PLAN,
        )
        self.silos = {s: InProcessSilo(s, values_of(s), tmp_path / s) for s in [*FIRST, LATE]}
        self.peers = peers_of(list(self.silos.values()))
        self.store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
        for silo in self.silos:
            self.store.register_silo(silo, "c", "v", {})
        self.driver = RoundDriver(
            config=config,
            store=self.store,
            method=PLAN.build_method(),
            layer=SecAggSum(),
            side=SecAggSum().aggregator_side(PartyKeys(peers=self.peers)),
            sign=lambda blob: b"not checked here",
            recorder=None,
            echo=lambda _: None,
        )
        self.sums: list[tuple[Sums, list[str]]] = []
        self.summed = threading.Event()
        self.aborted = threading.Event()
        step, self.driver.committer.next_state = self.driver.committer.next_state, self._abort_first
        self._next_state = step
        # it ignores the survivor set it asked silos to release for (an honest aggregator retries over it)
        self.driver._pinned = lambda round_number, stop: []
        self.stop = threading.Event()

    def _abort_first(self, attempt, sums: Sums, stop: threading.Event):
        self.sums.append((sums, list(attempt.contributors)))
        self.summed.set()
        if len(self.sums) == 1:
            if self.forgetful:
                for silo in FIRST:
                    (self.silos[silo].state_dir / LEDGER).unlink()
            raise SumAborted("aborted on purpose, after the sum")
        return self._next_state(attempt, sums, stop)

    def run(self) -> None:
        threads = [self.silos[s].start(self.driver.inbox, self.peers, self.stop) for s in FIRST]
        driver = threading.Thread(target=self.driver.run, args=(self.stop,), daemon=True)
        driver.start()
        assert self.summed.wait(60), "the first attempt was never summed"
        threads.append(self.silos[LATE].start(self.driver.inbox, self.peers, self.stop))
        try:
            self._wait_for_second_attempt()
        finally:
            self.stop.set()
            driver.join(timeout=30)
            for thread in threads:
                thread.join(timeout=10)
            self.store.close()
        assert not [e for s in self.silos.values() for e in s.errors]

    def _wait_for_second_attempt(self) -> None:
        """Until a second sum (the attack worked) or a second attempt aborted (the silos refused it)."""
        for _ in range(120):
            # through the store's lock: the driver thread checkpoints the same connection
            if len(self.sums) > 1 or self.store.attempt_statuses().count("aborted") >= 2:
                return
            self.summed.clear()
            self.summed.wait(0.5)
        raise AssertionError("no second attempt ended")


def contribution(silo: str) -> torch.Tensor:
    schema = PLAN.build_method().schema(PLAN.build_method().init_state(seed=0))
    values = schema.unflatten(torch.zeros(schema.size, dtype=torch.float64))
    values.update(values_of(silo)(schema, 1))
    return values["delta"]


def test_the_attack_works_against_silos_that_forget_what_they_signed(tmp_path):
    attack = Subtraction(tmp_path, forgetful=True)
    attack.run()
    (first, first_silos), (second, second_silos) = attack.sums[:2]
    assert first_silos == FIRST
    assert second_silos == [*FIRST, LATE]
    recovered = second["delta"] - first["delta"]
    assert torch.allclose(
        recovered, contribution(LATE), atol=1e-4
    )  # the late silo's n·Δw, to codec precision


def test_silos_refuse_to_sign_a_second_survivor_set_for_the_round_so_no_second_sum_is_formed(tmp_path):
    attack = Subtraction(tmp_path, forgetful=False)
    attack.run()
    assert len(attack.sums) == 1
    for silo in FIRST:
        assert any("would let the aggregator subtract the two sums" in r for r in attack.silos[silo].refusals)
    assert not any("subtract" in r for r in attack.silos[LATE].refusals)  # it released nothing twice


CENSUS_SCHEMA = Schema((Field("n", (), 100.0, frac_bits=0), Field("rows", (3, 2), 10.0, per_class=True)))


def census_round(
    tmp_path,
    census: Census,
    *,
    holds: list[int],
    members: str = "abcd",
    **options: object,
) -> Participation:
    """Silo "a"'s part in a round whose RoundSpec names the phase's census (per-class rows: `holds`), on the
    release ledger in `tmp_path`; `options` go to `Participation` (its noise, the plan's class names)."""
    rows = torch.zeros(3, 2, dtype=torch.float64)
    rows[holds] = 1.0
    spec = round_pb2.RoundSpec(
        consortium_id="c",
        round=2,
        round_id="r2.a1.x",
        config_sha256="plan",
        schema=schema_to_pb(CENSUS_SCHEMA),
        privacy="secagg",
        participants=list(census.silos),
        secagg=round_pb2.SecAggParameters(k_min=2),
        census=round_pb2.Census(silos=census.silos, silos_per_class=census.counts),
    )
    ledger = ReleaseLedger(tmp_path)
    return Participation(
        spec,
        roundspec.sums_of(round_pb2.SignedRoundSpec(spec=spec.SerializeToString()), spec),
        CENSUS_SCHEMA.flatten({"n": torch.tensor(1.0, dtype=torch.float64), "rows": rows}),
        me="a",
        side=SecAggSum().silo_side(PartyKeys(policy=SessionPolicy())),
        gate=ReleaseGate(consortium="c", floors=Floors(), members=lambda: members, ledger=ledger),
        trained_from="state",
        ledger=ledger,
        transport=None,
        on_sent=lambda purpose, message: None,
        **options,
    )


def test_a_silo_that_signed_a_census_but_kept_none_takes_no_count_on_trust(tmp_path):
    """Finding 7, its last way round: the aggregator withholds the census's sum after the silos signed its
    consistency round, aborts, and names inflated counts in the next RoundSpec (fedlt before issue 30 took
    them, checked only for plausibility, so a class one silo holds could be lifted to k_min). A silo that
    computed no census of its own now refuses any counts, true or not, until the census is taken again;
    once kept, it takes only that census."""
    signed = ["a", "b", "c"]
    key = Subject("census", np.array([1, 0, 1], dtype="<u8").tobytes()).key("c")  # "a" holds classes 0, 2
    ReleaseLedger(tmp_path).pin_survivors(key, signed, "census")
    for claimed in ([3, 1, 2], [3, 2, 2]):  # the true census, and class 1 (held by one silo) lifted to 2
        with pytest.raises(CensusError, match="signed for but never computed"):
            census_round(tmp_path, Census.of(signed, claimed), holds=[0, 2])
    assert ReleaseLedger(tmp_path).census(key) is None
    census = Census.of(signed, [3, 1, 2])
    ReleaseLedger(tmp_path).record_census(key, census)  # computed when the census was taken again
    census_round(tmp_path, census, holds=[0, 2])
    with pytest.raises(CensusError, match="differs from the census this silo took part in"):
        census_round(tmp_path, Census.of(signed, [3, 2, 2]), holds=[0, 2])
    with pytest.raises(CensusError, match="differs from the census this silo took part in"):
        census_round(tmp_path, Census.of(["a", "b", "d"], [3, 1, 2]), holds=[0, 2])


# ---------------------------------------------------------------- MFSC disclosures, one per state and data


MADE = {"mask": "gaussian", "min_samples": 5}


def test_every_disclosure_is_kept_by_its_key_across_restarts_and_writers(tmp_path):
    """Guards against one slot: a disclosure of another state (another study's round) no longer evicts the
    first, across a restart and another writer on the same state directory; a writer that made its own
    values for a key another writer kept first is handed the kept ones."""
    first, second = ReleaseLedger(tmp_path), ReleaseLedger(tmp_path)
    assert first.record_disclosure("s/d", b"means of s", MADE) == b"means of s"
    assert second.record_disclosure("t/d", b"means of t", MADE) == b"means of t"
    assert second.record_disclosure("s/d", b"redrawn masks", {"mask": "uniform", "min_samples": 9}) == (
        b"means of s"
    )
    reopened = ReleaseLedger(tmp_path)
    assert (reopened.disclosure("s/d"), reopened.disclosure("t/d")) == (b"means of s", b"means of t")
    assert reopened.disclosure_settings("s/d") == MADE


def test_past_the_bound_a_disclosure_keeps_its_settings_and_digest_not_its_values(tmp_path, monkeypatch):
    """The file is rewritten whole at every change, so the values kept are bounded; what is dropped can be
    made again with the settings kept, and only the same bytes are let out again: other values for a dropped
    key are refused (a silo whose features no longer compute alike would tell its masks apart)."""
    monkeypatch.setattr(releases, "KEPT_DISCLOSURES", 2 * len(base64.b64encode(b"x" * 30)))
    ledger = ReleaseLedger(tmp_path)
    for k in range(4):
        ledger.record_disclosure(f"s{k}/d", bytes([k]) * 30, MADE | {"min_samples": k + 5})
    reopened = ReleaseLedger(tmp_path)
    assert [reopened.disclosure(f"s{k}/d") is not None for k in range(4)] == [False, False, True, True]
    assert reopened.disclosure_settings("s0/d") == MADE
    with pytest.raises(RepeatedRelease, match="disclosed other class means for this state and data"):
        reopened.record_disclosure("s0/d", b"y" * 30, MADE)
    assert reopened.record_disclosure("s0/d", bytes([0]) * 30, MADE) == bytes([0]) * 30
    assert ReleaseLedger(tmp_path).disclosure("s0/d") == bytes([0]) * 30  # the newest again: kept
    assert ReleaseLedger(tmp_path).disclosure("s2/d") is None


def test_the_newest_disclosure_is_kept_whatever_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(releases, "KEPT_DISCLOSURES", 1)
    ledger = ReleaseLedger(tmp_path)
    ledger.record_disclosure("s/d", b"means of s", MADE)
    ledger.record_disclosure("t/d", b"means of t", MADE)
    assert (ledger.disclosure("s/d"), ledger.disclosure("t/d")) == (None, b"means of t")


def test_a_ledger_with_the_one_disclosure_of_an_older_agent_stays_readable(tmp_path, monkeypatch):
    """A ledger written before disclosures were kept by key held one, under "disclosure": it is read as
    that one disclosure, whose values are never dropped (the settings it was made with are unknown), and
    the file takes further disclosures."""
    monkeypatch.setattr(releases, "KEPT_DISCLOSURES", 1)
    older = {
        "survivors": {},
        "censuses": {},
        "disclosure": {"key": "s/d", "values": base64.b64encode(b"older means").decode()},
        "keys": KEY_VERSION,
        "v2": [],
    }
    (tmp_path / LEDGER).write_text(json.dumps(older))
    ledger = ReleaseLedger(tmp_path)
    assert (ledger.disclosure("s/d"), ledger.disclosure_settings("s/d")) == (b"older means", None)
    ledger.record_disclosure("t/d", b"means of t", MADE)
    ledger.record_disclosure("u/d", b"means of u", MADE)
    reopened = ReleaseLedger(tmp_path)
    assert [reopened.disclosure(k) for k in ("s/d", "t/d", "u/d")] == [b"older means", None, b"means of u"]


@pytest.mark.parametrize(
    "slot", [{"key": "s/d"}, {"key": 3, "values": "bWVhbnM="}, {"key": "s/d", "values": "not base64!"}]
)
def test_a_damaged_disclosure_of_an_older_agent_is_a_clear_error(tmp_path, slot):
    older = {"survivors": {}, "censuses": {}, "disclosure": slot}
    (tmp_path / LEDGER).write_text(json.dumps(older))
    with pytest.raises(LedgerMissing, match="holds a damaged disclosure"):
        ReleaseLedger(tmp_path)


def test_a_ledger_that_lost_a_disclosure_while_the_silo_ran_is_refused_not_rewritten(tmp_path):
    """A lost disclosure (an older copy put back) would let the silo make it again with another plan's mask
    and minimum: refused as a lost pin is."""
    ledger = ReleaseLedger(tmp_path)
    older = (tmp_path / LEDGER).read_bytes()
    ledger.record_disclosure("s/d", b"means of s", MADE)
    (tmp_path / LEDGER).write_bytes(older)
    with pytest.raises(LedgerMissing, match="replaced by an older copy"):
        ledger.record_disclosure("t/d", b"means of t", MADE)
