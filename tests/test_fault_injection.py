"""Fault injection: the aggregator SIGKILLed again and again across every stage of secure rounds, silos
SIGKILLed after each message of the census and contribution sums, and traffic dropped, delayed, reordered and
stalled by a proxy, with everything restarted, must still end with every round committed once, the simulator's
model bit for bit, a sound database, a complete audit chain and consistent silo ledgers.

The aggregator test watches the aggregator's own status page (`/status.json`, which names the stage:
gathering, each stage of the census and contribution sums, committing) and kills it a random moment after it
enters a stage drawn at random, with a seeded generator so a failure can be replayed. Stages that pass too
quickly to be seen are counted as such; the test asks for a kill in each kind of stage it could see.
"""

from __future__ import annotations

import http.client
import json
import random
import sqlite3
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from fedlt.methods import METHODS, MethodChoice
from tests.chaos_proxy import Chaos, ChaosProxy
from tests.consortium_harness import PLAN, Consortium
from tests.test_consortium import assert_same_model, contributors, simulated_state

ROUNDS = 60  # enough that twenty kills land before the run ends (13 did in 30 rounds)
KILLS = 20
SEED = 16
# RedGrape uploads per-class gradients every round, so round 1 runs a census before its contribution sum
METHOD = MethodChoice("redgrape", METHODS["redgrape"].Options())
PLAN_RG = replace(PLAN, method=METHOD)
# the kinds of moment a kill lands in, by what the status page's stage names
KINDS = (
    "gathering",
    "census sum",
    "contribution sum, keys",
    "shares",
    "masked",
    "consistency",
    "unmask",
    "committing",  # brief: often passed before it is seen, and the kill lands in the next stage instead
)


def _stage(url: str, token: str) -> str | None:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    try:
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("GET", "/status.json", headers={"Authorization": f"Bearer {token}"})
        return json.loads(connection.getresponse().read())["stage"]
    except (OSError, ValueError, KeyError):
        return None  # starting, or just killed


def _page(consortium: Consortium) -> tuple[str, str]:
    """The status page's address and its access token (every start writes a new one)."""
    listening = json.loads((consortium.data_dir / "listening.json").read_text())
    return listening["status_page"], Path(listening["status_page_token"]).read_text().strip()


def _kind(stage: str) -> str:
    for kind in KINDS:
        if kind in stage:
            return kind
    return stage


def _kill_in_a_stage(
    consortium: Consortium, wanted: str, rng: random.Random, timeout: float = 180
) -> str | None:
    """Kill the aggregator a random 0–0.3 s after it is seen in the `wanted` kind of stage (in any stage after
    20 s of not seeing it); None if the run finished first."""
    url, token = _page(consortium)
    until = time.monotonic() + timeout
    patience = time.monotonic() + 20
    assert consortium.aggregator is not None
    while time.monotonic() < until and consortium.aggregator.poll() is None:
        stage = _stage(url, token)
        if stage and stage != "finished" and (_kind(stage) == wanted or time.monotonic() > patience):
            time.sleep(rng.uniform(0.0, 0.3))
            if consortium.aggregator.poll() is not None:
                return None
            consortium.kill(consortium.aggregator)
            return f"{_kind(stage)} ({stage})"
        time.sleep(0.02)
    return None


@pytest.mark.slow
def test_twenty_kills_across_secure_round_stages_lose_and_repeat_nothing(tmp_path):
    consortium = Consortium.create(
        tmp_path / "c", rounds=ROUNDS, min_silos=3, round_timeout=120, plan=PLAN_RG
    )
    rng = random.Random(SEED)
    killed_in: list[str] = []
    try:
        consortium.start()
        while len(killed_in) < KILLS:
            # each kind once first (the census runs only until its first sum is kept), then at random
            wanted = KINDS[len(killed_in)] if len(killed_in) < len(KINDS) else rng.choice(KINDS)
            moment = _kill_in_a_stage(consortium, wanted, rng)
            if moment is None:
                break
            killed_in.append(moment)
            consortium.output.clear()
            consortium.start_aggregator()
        assert consortium.wait_aggregator(timeout=600) == 0
    finally:
        consortium.stop()
    assert_nothing_lost_or_repeated(consortium, tmp_path, ROUNDS, silos=3)
    print("killed in:", *killed_in, sep="\n  ")
    kinds = {k.split(" (")[0] for k in killed_in}
    assert len(killed_in) >= KILLS, f"only {len(killed_in)} kills before the run ended: {killed_in}"
    assert {"gathering", "census sum", "contribution sum, keys", "masked"} <= kinds, killed_in


def assert_nothing_lost_or_repeated(consortium: Consortium, tmp_path: Path, rounds: int, silos: int) -> None:
    """Every round committed once, over every silo (the runs take `min_silos` = all); no open attempt; a sound
    database and audit chain; one census; the simulator's model bit for bit; every silo ended cleanly, its
    release ledger signed for no smaller survivor set than the whole consortium."""
    database = consortium.data_dir / "consortium.sqlite"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        committed = [r for (r,) in db.execute("SELECT round FROM states ORDER BY round")]
        open_attempts = db.execute("SELECT COUNT(*) FROM attempts WHERE status = 'open'").fetchone()[0]
    assert committed == list(range(rounds + 1)), "no round lost or repeated"
    assert open_attempts == 0
    store = consortium.store()
    try:
        store.verify_audit()
        events = [r.event for r in store.audit_log()]
    finally:
        store.close()
    assert events.count("round_committed") == rounds
    assert events.count("census_taken") == 1, "silos sign one census a phase, restarts or not"
    expected = simulated_state(tmp_path, rounds=rounds, method=METHOD, silos=silos)
    assert_same_model(consortium.final_state(), expected, atol=0)
    everyone = [f"silo-{k}" for k in range(silos)]
    for k, silo in consortium.silos.items():
        log = (consortium.directory / f"silo-{k}.log").read_text()
        assert silo.wait(60) == 0, f"silo-{k} ends cleanly:\n{log[-4000:]}"
        ledger = json.loads((consortium.directory / f"silo-{k}-state" / "releases.json").read_text())
        pinned = ledger["survivors"]
        assert 1 <= len(pinned) <= rounds + 1, pinned  # a release per round, and the census
        assert all(survivors == everyone for survivors in pinned.values()), pinned
        assert [c["silos"] for c in ledger["censuses"].values()] == [everyone]


# --- silos killed after each message of a secure sum ----------------------------------------------------

# (silo, drill), one at a time: the silo is restarted to stop after sending that message
# (`silo.finish.DRILL`), SIGKILLed once it has, and restarted without a drill. Census drills come first: after
# the census is kept there is none to stop in.
# Keys and shares before the masked input leave too few silos and abort the attempt, which is retried; a
# silo gone after its masked input is unmasked from its peers' shares and the round commits.
SILO_DRILLS = (
    (0, "census:keys"),
    (1, "census:shares"),
    (2, "census:unmask"),
    (3, "keys"),
    (0, "shares"),
    (1, "masked"),
    (2, "consistency"),
    (3, "unmask"),
    (0, "masked"),
    (1, "keys"),
)
SILO_ROUNDS = 16


def _drill_stops(consortium: Consortium, k: int) -> int:
    log = consortium.directory / f"silo-{k}.log"
    return log.read_text().count("drill: stopping") if log.exists() else 0


@pytest.mark.slow
def test_silos_killed_after_every_message_of_a_secure_sum_lose_and_repeat_nothing(tmp_path):
    """4 silos, all needed (`min_silos` = 4, threshold 3): a silo killed before its masked input aborts the
    attempt, one killed after it is recovered; either way every committed round holds every silo's input
    once."""
    consortium = Consortium.create(
        tmp_path / "c", rounds=SILO_ROUNDS, min_silos=4, silos=4, round_timeout=120, plan=PLAN_RG
    )
    rng = random.Random(SEED)
    try:
        first_silo, first_drill = SILO_DRILLS[0]
        consortium.start(drills={first_silo: first_drill})
        for i, (k, drill) in enumerate(SILO_DRILLS):
            stops = _drill_stops(consortium, k)
            if i:  # arm the drill: a kill at a random moment of whatever the silo is doing
                time.sleep(rng.uniform(0.0, 2.0))
                consortium.kill(consortium.silos[k])
                consortium.start_silo(k, drill)
            until = time.monotonic() + 300
            while _drill_stops(consortium, k) == stops and time.monotonic() < until:
                time.sleep(0.05)
            assert _drill_stops(consortium, k) > stops, f"drill {i} ({drill} at silo-{k}) never stopped it"
            consortium.kill(consortium.silos[k])
            consortium.start_silo(k)
        assert consortium.wait_aggregator(timeout=900) == 0
    finally:
        consortium.stop()
    assert_nothing_lost_or_repeated(consortium, tmp_path, SILO_ROUNDS, silos=4)


@pytest.mark.slow
def test_a_round_released_over_fewer_silos_is_retried_over_exactly_them_after_a_restart(tmp_path):
    """Silos sign one survivor set a round (silo.releases). Silo-3 leaves round 1 after its shares, so the
    other three are asked to release it over themselves; the aggregator is killed while they do, and restarted
    with all four connected. A retry over the four would be refused by the three, attempt after attempt: the
    aggregator keeps the set it asked for and retries the round over exactly that set."""
    consortium = Consortium.create(tmp_path / "c", rounds=2, min_silos=3, silos=4, round_timeout=120)
    try:
        consortium.start(drills={3: "shares", 0: "consistency"})
        consortium.wait_for_silo_log(3, "drill: stopping", timeout=300)
        consortium.kill(consortium.silos[3])
        consortium.start_silo(3)  # back, but round 1 goes on over the other three
        consortium.wait_for_silo_log(0, "drill: stopping", timeout=300)
        consortium.kill(consortium.aggregator)
        consortium.kill(consortium.silos[0])
        consortium.start_silo(0)
        config = consortium.directory / "consortium.toml"  # the retry waits for all four to be back
        config.write_text(config.read_text().replace("gather = 3.0", "gather = 60.0"))
        consortium.output.clear()
        consortium.start_aggregator()
        assert consortium.wait_aggregator(timeout=300) == 0
    finally:
        consortium.stop()
    assert contributors(consortium)[1] == ["silo-0", "silo-1", "silo-2"]
    store = consortium.store()
    try:
        attempts = store._db.execute("SELECT COUNT(*) FROM attempts WHERE round = 1").fetchone()[0]
    finally:
        store.close()
    assert attempts == 2, "one retry, over the three"
    for k in range(3):
        ledger = json.loads((consortium.directory / f"silo-{k}-state" / "releases.json").read_text())
        assert ["silo-0", "silo-1", "silo-2"] in ledger["survivors"].values()


# --- traffic dropped, delayed, reordered and stalled ------------------------------------------------------

CHAOS = Chaos(delay=0.02, late=0.005, late_seconds=6.0, lifetime=60.0)
CHAOS_ROUNDS = 12


@pytest.mark.slow
def test_dropped_delayed_reordered_and_stalled_traffic_loses_and_repeats_nothing(tmp_path):
    """Each silo dials the aggregator through its own chaos proxy; every mishap ends a connection or an
    attempt, never a round twice or a wrong model. A stalled link, which neither end sees close, is found by
    gRPC keepalive pings on both sides."""
    consortium = Consortium.create(
        tmp_path / "c", rounds=CHAOS_ROUNDS, min_silos=3, silos=3, round_timeout=60, plan=PLAN_RG
    )
    rng = random.Random(SEED)
    proxies: list[ChaosProxy] = []
    mishaps = ChaosProxy.turns()
    try:
        consortium.start_aggregator()
        for k, config in enumerate(consortium.silo_configs):
            proxies.append(ChaosProxy(consortium.address, CHAOS, random.Random(rng.random()), mishaps))
            config.write_text(config.read_text().replace(consortium.address, proxies[-1].address))
            consortium.start_silo(k)
        assert consortium.wait_aggregator(timeout=1500) == 0
    finally:
        consortium.stop()
        for proxy in proxies:
            proxy.close()
    counts = sum((p.counts for p in proxies), Counter())
    print("chaos:", dict(counts))
    assert_nothing_lost_or_repeated(consortium, tmp_path, CHAOS_ROUNDS, silos=3)
    for mishap in ("cut", "swap", "stall", "late"):
        assert counts[mishap], f"no {mishap} happened: {counts}"
