"""Fault injection: the aggregator SIGKILLed again and again across every stage of secure rounds, restarted
each time, must still end with every round committed once, the simulator's model bit for bit, a sound database
and a complete audit chain.

The test watches the aggregator's own status page (`/status.json`, which names the stage: gathering, each
stage of the census and contribution sums, committing) and kills it a random moment after it enters a
stage drawn at random, with a seeded generator so a failure can be replayed. Stages that pass too quickly to
be seen are counted as such; the test asks for a kill in each kind of stage it could see.
"""

from __future__ import annotations

import http.client
import json
import random
import sqlite3
import time
from dataclasses import replace

import pytest

from fedlt.methods import METHODS, MethodChoice
from tests.consortium_harness import PLAN, Consortium
from tests.test_consortium import assert_same_model, simulated_state

ROUNDS = 60  # enough that twenty kills land before the run ends (13 did in 30 rounds)
KILLS = 20
SEED = 16
# RedGrape uploads per-class gradients every round, so round 1 runs a census before its contribution sum
METHOD = MethodChoice("redgrape", METHODS["redgrape"].Options())
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


def _stage(url: str) -> str | None:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    try:
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("GET", "/status.json")
        return json.loads(connection.getresponse().read())["stage"]
    except (OSError, ValueError, KeyError):
        return None  # starting, or just killed


def _page(consortium: Consortium) -> str:
    return json.loads((consortium.data_dir / "listening.json").read_text())["status_page"]


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
    url = _page(consortium)
    until = time.monotonic() + timeout
    patience = time.monotonic() + 20
    assert consortium.aggregator is not None
    while time.monotonic() < until and consortium.aggregator.poll() is None:
        stage = _stage(url)
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
    plan = replace(PLAN, method=METHOD)
    consortium = Consortium.create(tmp_path / "c", rounds=ROUNDS, min_silos=3, round_timeout=120, plan=plan)
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

    database = consortium.data_dir / "consortium.sqlite"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        committed = [r for (r,) in db.execute("SELECT round FROM states ORDER BY round")]
        open_attempts = db.execute("SELECT COUNT(*) FROM attempts WHERE status = 'open'").fetchone()[0]
    assert committed == list(range(ROUNDS + 1)), "no round lost or repeated"
    assert open_attempts == 0
    store = consortium.store()
    try:
        store.verify_audit()
        events = [r.event for r in store.audit_log()]
    finally:
        store.close()
    assert events.count("round_committed") == ROUNDS
    assert events.count("census_taken") == 1, "silos sign one census a phase, restarts or not"
    expected = simulated_state(tmp_path, rounds=ROUNDS, method=METHOD)
    assert_same_model(consortium.final_state(), expected, atol=0)
    for k, silo in consortium.silos.items():
        log = (consortium.directory / f"silo-{k}.log").read_text()
        assert silo.wait(60) == 0, f"silo-{k} ends cleanly:\n{log}"
    print("killed in:", *killed_in, sep="\n  ")
    kinds = {k.split(" (")[0] for k in killed_in}
    assert len(killed_in) >= KILLS, f"only {len(killed_in)} kills before the run ended: {killed_in}"
    assert {"gathering", "census sum", "contribution sum, keys", "masked"} <= kinds, killed_in
