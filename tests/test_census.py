"""The census and the tail guard through the real round driver and the silo's `SecureRound`, in one process.

FedAvg has no per-class field, so no consortium method runs the census yet; this test gives FedAvg one and
connects the silos' protocol code to the inbox directly (what the gRPC service would relay), to check that
classes held by fewer than k_min silos come out of the released sum as zeros, and that the audit log names
the classes held back and nothing about who holds them.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from aggregator.config import ConsortiumConfig, ConsortiumSection, TimeoutSection
from aggregator.rounds import RoundDriver
from aggregator.store import Store
from fedlt.aggregation import Field, Schema
from fedlt.aggregation.halves import PartyKeys
from fedlt.methods.fedavg import FedAvg
from privacy.secagg.layer import SecAggSum
from tests.consortium_harness import AUDIT_KEY, PLAN
from tests.engine_harness import InProcessSilo, peers_of

CLASSES = 4
HOLDINGS = {"a": (0, 1), "b": (0, 1, 2), "c": (0, 3)}  # silos per class: 3, 2, 1, 1


class PerClassFedAvg(FedAvg):
    """FedAvg plus a per-class field, whose sums it keeps for the test to read."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sums_seen: list[dict[str, torch.Tensor]] = []

    def _schema(self, state):
        extra = Field("per_class", (CLASSES, 2), 100.0, per_class=True)
        return Schema((*super()._schema(state).fields, extra))

    def _server_step(self, state, sums, ctx):
        self.sums_seen.append({k: v.clone() for k, v in sums.items()})
        return super()._server_step(state, sums, ctx)


def values_of(silo: str):
    def values(schema, round_number):
        per_class = torch.zeros(CLASSES, 2, dtype=torch.float64)
        for c in HOLDINGS[silo]:
            per_class[c] = torch.tensor([1.0, c + 0.5])
        return {"n": torch.tensor(5.0, dtype=torch.float64), "per_class": per_class}

    return values


def records_of(silo: str) -> np.ndarray:
    """Two records of each class the silo holds: class 1's two silos reach the record floor (3) together."""
    return np.bincount(np.repeat(HOLDINGS[silo], 2), minlength=CLASSES)


def test_census_holds_back_classes_fewer_than_k_min_silos_hold(tmp_path):
    config = ConsortiumConfig(
        consortium=ConsortiumSection(rounds=1, min_silos=3),
        timeouts=TimeoutSection(gather=1.0, round=60.0, stage=30.0),
        plan=PLAN,
    )
    assert config.consortium.privacy == "secagg"
    assert config.layer_settings().k_min == 2
    silos = [InProcessSilo(name, values_of(name), tmp_path / name, records_of(name)) for name in HOLDINGS]
    peers = peers_of(silos)
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    for silo in HOLDINGS:
        store.register_silo(silo, "c", "v", {})
    method = PerClassFedAvg(
        options=PLAN.method.options,
        train=PLAN.train,
        model=PLAN.build_method().model_spec,
        rounds=config.consortium.rounds,
    )
    driver = RoundDriver(
        config=config,
        store=store,
        method=method,
        layer=SecAggSum(),
        side=SecAggSum().aggregator_side(PartyKeys(peers=peers)),
        sign=lambda blob: b"not checked here",
        recorder=None,
        echo=lambda _: None,
    )
    stop = threading.Event()
    threads = [silo.start(driver.inbox, peers, stop) for silo in silos]
    thread = threading.Thread(target=driver.run, args=(stop,), daemon=True)
    thread.start()
    thread.join(timeout=60)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    errors = [e for silo in silos for e in silo.errors + silo.refusals]
    assert not errors
    assert driver.failure is None
    assert driver.table.held.round == 1
    (sums,) = method.sums_seen
    expected = torch.zeros(CLASSES, 2, dtype=torch.float64)
    expected[0] = torch.tensor([3.0, 1.5])  # three silos hold class 0
    expected[1] = torch.tensor([2.0, 3.0])  # two hold class 1: exactly k_min, released
    assert torch.allclose(sums["per_class"], expected, atol=1e-6)  # classes 2 and 3: one silo each, zeroed
    assert float(sums["n"]) == 15.0
    guard = [r.detail for r in store.audit_log() if r.event == "tail_guard"]
    assert guard == [
        {"round_id": guard[0]["round_id"], "k_min": 2, "zeroed": [2, 3], "record_floor": 0, "floored": []}
    ]
    store.close()
