"""A ckks consortium of real processes: the aggregator adds ciphertexts, silos step the model themselves.

What it must show: the model the silos end with is the plaintext simulator's within CKKS's precision, every
silo computed the same state (the digests they log and the one the aggregator keeps agree), the operator
still sees accuracy (from the silos' summed evaluation counts), and nothing the aggregator keeps or logs holds
the secret key, a plaintext contribution or a plaintext model.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import replace

import pytest

from aggregator.held_state import HeldState
from fedlt.methods import METHODS, MethodChoice
from fedlt.methods.state import pack_state, unpack_state
from fedlt.tensorpack import PackError
from privacy.ckks.keys import CkksKeyError, SecretContext
from privacy.stepping.sealed_state import open_state
from tests.consortium_harness import PLAN, Consortium
from tests.test_consortium import assert_same_model, make_consortium, simulated_run  # noqa: F401

ROUNDS = 2
# The scale leaves room for n times each field's bound, so a decrypted sum is exact to about 2^-30 of that
# bound; two rounds of FedAvg on this small model stay within 1e-4 of the plaintext run.
PRECISION = 1e-4
STEPPED = re.compile(r"round (\d+): stepped the model to state ([0-9a-f]{64})")


def _secret(consortium: Consortium, k: int) -> SecretContext:
    (path,) = (consortium.directory / f"silo-{k}-state" / "ckks").glob("*.secret")
    return SecretContext.from_secret_bytes(path.read_bytes())


def _windows(data: bytes, width: int = 48, count: int = 8) -> list[bytes]:
    """Slices from across `data`, each long enough that finding one elsewhere by chance is impossible."""
    step = max(1, (len(data) - width) // count)
    return [data[i : i + width] for i in range(0, len(data) - width, step)][:count]


# CReFF (census, tail guard, a server step that retrains the classifier) is the longer run: `make test-all`
@pytest.mark.parametrize("name", ["fedavg", pytest.param("creff", marks=pytest.mark.slow)])
def test_a_ckks_consortium_trains_the_plaintext_model_without_the_aggregator_reading_it(
    make_consortium,  # noqa: F811
    tmp_path,
    name,
):
    plan = replace(PLAN, method=MethodChoice(name, METHODS[name].Options()))
    consortium = make_consortium(rounds=ROUNDS, min_silos=3, privacy="ckks", plan=plan)
    consortium.start()
    assert consortium.wait_aggregator(timeout=300) == 0, "\n".join(consortium.output[-30:])
    consortium.stop()

    # every silo computed the same state each round, and the aggregator committed exactly that one
    logs = [(consortium.directory / f"silo-{k}.log").read_text() for k in range(3)]
    stepped = [dict(STEPPED.findall(log)) for log in logs]
    assert all(len(s) == ROUNDS for s in stepped), logs
    assert stepped[0] == stepped[1] == stepped[2]
    store = consortium.store()
    try:
        latest = store.latest_state()
        metrics = store.metrics_history()
    finally:
        store.close()
    assert latest.round == ROUNDS
    assert latest.digest == stepped[0][str(ROUNDS)]

    # the sealed state opens with a silo's key to the plaintext model, within CKKS's precision
    secret = _secret(consortium, 1)
    sealed = HeldState.from_stored(latest.data, latest.round, latest.digest, plan.build_method()).blob
    final = unpack_state(
        open_state(
            secret, consortium="test-consortium", round_number=ROUNDS, digest=latest.digest, sealed=sealed
        ),
        ROUNDS,
    )
    assert final.digest() == latest.digest
    plaintext = simulated_run(tmp_path, rounds=ROUNDS, privacy="plaintext", method=plan.method)
    assert_same_model(final, plaintext.state, atol=PRECISION)
    # the operator saw accuracy, summed from the silos' counts, as the plaintext run measured it
    assert [m["round"] for m in metrics] == list(range(1, ROUNDS + 1))
    assert metrics[-1]["accuracy"] == pytest.approx(plaintext.metrics["rounds"][-1]["accuracy"], abs=0.02)

    # nothing the aggregator keeps or logs holds the secret key, the model, or a contribution in the clear
    kept = (consortium.data_dir / "consortium.sqlite").read_bytes()
    logged = "\n".join(consortium.output).encode()
    for secret_part in _windows(secret.secret_bytes()[-4096:]):
        assert secret_part not in kept
        assert secret_part not in logged
    model_bytes = pack_state(final)
    for model_part in _windows(model_bytes[len(model_bytes) // 2 :]):
        assert model_part not in kept
        assert model_part not in logged
    db = sqlite3.connect(consortium.data_dir / "consortium.sqlite")
    try:
        blobs = [
            value
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            for row in db.execute(f"SELECT * FROM {table}")
            for value in row
            if isinstance(value, bytes)
        ]
        states = db.execute("SELECT round, data FROM states ORDER BY round").fetchall()
    finally:
        db.close()
    for blob in blobs:
        with pytest.raises(CkksKeyError):
            SecretContext.from_secret_bytes(blob)
    assert [r for r, _ in states] == list(range(ROUNDS + 1))
    unpack_state(states[0][1], 0)  # the seeded initial state is public, and the only one in the clear
    for round_number, data in states[1:]:
        with pytest.raises(PackError):
            unpack_state(data, round_number)


@pytest.mark.slow
def test_a_ckks_consortium_goes_on_without_a_killed_silo_and_still_reports_accuracy(make_consortium):  # noqa: F811
    """A silo killed after round 1: the rest decrypt, step and agree without it, and once it is gone their
    evaluation sum, masked over the silos that contributed, adds up to counts again. It is killed where a
    drill froze it, after signing round 1's evaluation sum and before taking round 2's RoundSpec: killed once
    it had uploaded to round 2, the others could release that round only over all four, and would wait for it
    (`silo.releases`)."""
    consortium = make_consortium(rounds=3, min_silos=3, silos=4, privacy="ckks")
    consortium.start(drills={3: "evaluation:consistency"})
    consortium.wait_for_silo_log(3, "drill: stopping", timeout=180)
    consortium.kill(consortium.silos[3])
    assert consortium.wait_aggregator(timeout=400) == 0, "\n".join(consortium.output[-30:])
    store = consortium.store()
    try:
        metrics = store.metrics_history()
    finally:
        store.close()
    evaluated = {m["round"]: len(m["contributors"]) for m in metrics}
    assert evaluated == {1: 4, 2: 3, 3: 3}
