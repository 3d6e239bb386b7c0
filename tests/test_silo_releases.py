"""One release per round: two attempts of a round must not subtract to one silo's contribution.

A silo's contribution depends only on the round, so every attempt carries the same vector. The attack: run
round r over {a, b, c}, learn the sum, abort instead of committing, and run it again over {a, b, c, v}; the
difference is v's contribution, with no colluder at all. It is mounted here with the real round driver and
the silos' own `Participation`, first against silos that forget what they signed (it works), then against
silos that keep their ledger (it does not).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from aggregator.config import ConsortiumConfig, ConsortiumSection, TimeoutSection
from aggregator.rounds import RoundDriver
from aggregator.store import Store
from fedlt.aggregation import Field, Schema, Sums
from fedlt.aggregation.gate import Floors, ReleaseGate, Subject
from fedlt.aggregation.halves import PartyKeys, SumAborted
from fedlt.aggregation.tail_guard import Census, CensusError
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from privacy import roundspec
from privacy.secagg.layer import SecAggSum
from privacy.secagg.settings import SessionPolicy
from silo.participation import Participation
from silo.releases import LEDGER, ReleaseLedger, RepeatedRelease
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


def census_round(tmp_path, census: Census, *, holds: list[int]) -> Participation:
    """This silo's part in a round whose RoundSpec names the phase's census (per-class rows: `holds`)."""
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
        gate=ReleaseGate(consortium="c", floors=Floors(), members=lambda: "abcd", ledger=ledger),
        trained_from="state",
        ledger=ledger,
        transport=None,
        on_sent=lambda purpose, message: None,
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
