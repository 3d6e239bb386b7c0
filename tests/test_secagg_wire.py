"""A secure round against a live aggregator, with the test playing both silos over real mutual TLS.

The silos run the agent's own `Participation`; before and during it the test sends what a faulty or hostile
silo might (forged keys, a masked input out of turn, a second set of keys), and checks each refusal's status
code and that the round still commits the right sum.
"""

from __future__ import annotations

import os
import queue
import threading

import grpc
import numpy as np
import torch

from fedlt.aggregation.gate import Floors, ReleaseGate
from fedlt.aggregation.halves import PartyKeys
from fedlt.methods.fedavg import FedAvgOptions
from fedlt.methods.state import flatten, float_keys
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, round_pb2
from fedlt.wire import schema_from_pb, submit_stream
from privacy import roundspec
from privacy.peers import ConsortiumPeers
from privacy.pki.identity import MemberTrust, RevokedSerials
from privacy.pki.roster import Roster
from privacy.pki.signing import load_private_key, sign
from privacy.secagg.layer import SecAggSum
from privacy.secagg.protocol import KEYS_CONTEXT
from privacy.secagg.settings import SessionPolicy
from silo.participation import Participation
from silo.releases import ReleaseLedger
from silo.transport import SiloTransport
from tests.consortium_harness import PLAN, Consortium, channel, code_of, read_all, register

CODE = grpc.StatusCode


def test_a_secure_round_played_by_hand_refuses_tampering_and_sums_right(tmp_path):
    consortium = Consortium.create(tmp_path, rounds=1, min_silos=2, silos=2, round_timeout=120.0)
    consortium.start_aggregator()
    pki = consortium.directory / "pki"
    roster = Roster.read(pki / "roster.json")
    peers = ConsortiumPeers(MemberTrust((pki / "ca" / "ca.pem").read_bytes(), roster, RevokedSerials()))
    try:
        with channel(consortium, "silo-0") as ch0, channel(consortium, "silo-1") as ch1:
            stubs = [consortium_pb2_grpc.ConsortiumServiceStub(ch) for ch in (ch0, ch1)]
            inboxes: list[queue.Queue] = [queue.Queue(), queue.Queue()]
            for ch, stub, inbox in zip((ch0, ch1), stubs, inboxes, strict=True):
                register(ch)
                threading.Thread(
                    target=read_all, args=(stub.Join(pb.JoinRequest()), inbox), daemon=True
                ).start()
            signed = [inbox.get(timeout=60).round_spec for inbox in inboxes]
            spec = round_pb2.RoundSpec.FromString(signed[0].spec)
            assert spec.privacy == "secagg"
            assert spec.secagg.k_min == 2
            keys = [load_private_key(pki / f"silo-{k}.key") for k in (0, 1)]
            round_id, secure_sum = spec.round_id, pb.SECURE_SUM_CONTRIBUTION

            # keys signed for another round: refused, whoever relays them
            forged = pb.AdvertiseKeysRequest(
                round_id=round_id,
                sum=secure_sum,
                c_public_key=os.urandom(32),
                s_public_key=os.urandom(32),
                signature=sign(keys[0], b"an earlier round", context=KEYS_CONTEXT),
            )
            code, details = code_of(lambda: stubs[0].AdvertiseKeys(forged, timeout=10))
            assert code == CODE.INVALID_ARGUMENT
            assert "signature does not verify" in details
            # a masked input before the masked stage, and a census that this round does not run
            size = sum(int(np.prod(f.shape)) for f in spec.schema.fields)
            early = submit_stream(
                round_id, bytes(8 * size), kind=pb.CONTRIBUTION_KIND_MASKED, purpose="contribution"
            )
            code, details = code_of(lambda: stubs[0].Submit(early, timeout=10))
            assert code == CODE.FAILED_PRECONDITION
            assert "not 'masked'" in details
            census = pb.AdvertiseKeysRequest(round_id=round_id, sum=pb.SECURE_SUM_CENSUS)
            code, _ = code_of(lambda: stubs[0].AdvertiseKeys(census, timeout=10))
            assert code == CODE.FAILED_PRECONDITION
            plaintext = submit_stream(
                round_id, bytes(8 * size), kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose="contribution"
            )
            code, details = code_of(lambda: stubs[0].Submit(plaintext, timeout=10))
            assert code == CODE.INVALID_ARGUMENT  # another layer's upload: no upload of this consortium's
            assert "carries no upload" in details

            schema = schema_from_pb(spec.schema)
            generator = torch.Generator().manual_seed(0)
            contributions = []
            for _ in (0, 1):
                values = schema.unflatten(torch.zeros(schema.size, dtype=torch.float64))
                values["delta"] = (5 / FedAvgOptions().max_silo_samples) * torch.randn(
                    schema.fields[0].shape, generator=generator, dtype=torch.float64
                )  # (n/N)·Δw
                values["n"] = torch.tensor(5.0, dtype=torch.float64)
                contributions.append(schema.flatten(values))
            ledgers = []
            for k in (0, 1):
                (tmp_path / f"silo-{k}").mkdir()
                ledgers.append(ReleaseLedger(tmp_path / f"silo-{k}"))
            rounds = [
                Participation(
                    spec,
                    roundspec.sums_of(signed[k], spec),
                    contributions[k],
                    me=f"silo-{k}",
                    side=SecAggSum().silo_side(
                        PartyKeys(
                            sign=lambda data, *, context, key=keys[k]: sign(key, data, context=context),
                            peers=peers,
                            policy=SessionPolicy(min_participants=2),  # the default refuses sums of two
                        )
                    ),
                    gate=ReleaseGate(
                        consortium=spec.consortium_id,
                        floors=Floors(participants=2, survivors=2),  # the default refuses sums of two
                        members=lambda: ("silo-0", "silo-1"),
                        ledger=ledgers[k],
                    ),
                    trained_from=spec.state_digest,
                    ledger=ledgers[k],
                    transport=SiloTransport(stubs[k], timeout=30),
                    on_sent=lambda purpose, message: None,
                )
                for k in (0, 1)
            ]
            for k in (0, 1):
                rounds[k].start()
            # a second, different set of keys from the same silo
            again = pb.AdvertiseKeysRequest(
                round_id=round_id, sum=secure_sum, c_public_key=os.urandom(32), s_public_key=os.urandom(32)
            )
            again.signature = sign(keys[0], b"", context=KEYS_CONTEXT)
            code, _ = code_of(lambda: stubs[0].AdvertiseKeys(again, timeout=10))
            assert code in (CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION)
            while not all(r.done for r in rounds):
                for k in (0, 1):
                    if not rounds[k].done:
                        rounds[k].step(inboxes[k].get(timeout=60).sum_step)
        assert consortium.wait_aggregator(timeout=120) == 0
        initial, final = PLAN.build_method().init_state(seed=0), consortium.final_state()
        keys_ = float_keys(initial.model)
        moved = flatten(final.model, keys_).double() - flatten(initial.model, keys_).double()
        # N · Σ (n/N)·Δw / Σ n with n = 5 each, N = the method's max_silo_samples (FedAvg's weighting), each
        # silo's value off by at most 2^-25 (24 fractional bits, rounded to nearest), then scaled by N / Σ n
        big = FedAvgOptions().max_silo_samples
        expected = (contributions[0][:-1] + contributions[1][:-1]) * big / 10.0
        assert (moved - expected).abs().max() <= 2 * 2.0**-25 * big / 10.0 * 1.001
    finally:
        consortium.stop()
