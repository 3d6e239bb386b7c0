"""A census over the consortium's wire: every message and step of the secagg layer's halves through its
Protobuf form, read as the aggregator's service reads requests (`privacy.wire.receivers`, `submitted`) and
as the silo agent reads steps (`step_from_pb`), so the signatures a census needs travel with the messages
they sign and every silo ends with the census it recomputed from the transcript.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pytest
import torch

from fedlt.aggregation.halves import AggregatorHalf, Released, SiloHalf, SumSpec, census_schema
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import submit_stream
from privacy.peers import ConsistencySignature
from privacy.secagg.layer import SecAggSum
from privacy.secagg.protocol import MaskedInput, ProtocolViolation, Reveal
from privacy.secagg.wire import masked_payload
from privacy.wire import received, receivers, send, step_from_pb, step_to_pb, submitted

CLASSES = 5
SILOS = ("silo-a", "silo-b", "silo-c", "silo-d")
PRESENT = {
    "silo-a": [1, 1, 0, 0, 1],
    "silo-b": [1, 0, 0, 0, 0],
    "silo-c": [1, 1, 1, 0, 0],
    "silo-d": [1, 0, 0, 0, 1],
}


class Relay:
    """A silo's stub answered as the aggregator's service answers it: each request serialized, parsed, read in
    the caller's name and handed to the aggregator's half, unless it is the silo's message that gets lost."""

    def __init__(self, silo: str, half: AggregatorHalf, *, lost: type | None = None) -> None:
        self.silo, self.half, self.lost = silo, half, lost

    def __getattr__(self, rpc: str):
        if rpc not in receivers():
            raise AttributeError(rpc)

        def call(request, **_: object) -> None:
            parsed = type(request).FromString(request.SerializeToString())
            self._deliver(received(rpc, parsed, silo=self.silo, credential=b"", layer="secagg"))

        return call

    def Submit(self, stream: Iterable[pb.SubmitRequest], timeout: float | None = None) -> None:  # noqa: N802
        first, *parts = (pb.SubmitRequest.FromString(p.SerializeToString()) for p in stream)
        self._deliver(submitted(first.header, b"".join(p.chunk for p in parts), layer="secagg"))

    def _deliver(self, message: object) -> None:
        if type(message) is not self.lost:
            self.half.receive(self.silo, message)


def over_the_wire(step: object) -> object:
    """A stage output as the silo agent reads it from its Join stream."""
    directive = pb.JoinResponse(sum_step=step_to_pb("r1.a1", "census", step))
    step = pb.JoinResponse.FromString(directive.SerializeToString()).sum_step
    purpose, read = step_from_pb(step, layer="secagg")
    assert purpose == "census"
    return read


def halves_of(spec: SumSpec) -> tuple[AggregatorHalf, dict[str, SiloHalf]]:
    sides, aggregator_side = SecAggSum().in_process(spec.silos)
    return aggregator_side.half(spec), {
        u: sides[u].half(spec, u, may_release=lambda _: None) for u in spec.silos
    }


def census(lost: Mapping[str, type]) -> tuple[Released, dict[str, SiloHalf]]:
    """A census of `SILOS` through the wire; `lost` maps a silo to the type of its message that is lost."""
    spec = SumSpec("r1.a1", "census", SILOS, census_schema(CLASSES))
    aggregator, halves = halves_of(spec)
    stubs = {u: Relay(u, aggregator, lost=lost.get(u)) for u in SILOS}

    def sent(u: str, messages: list[object]) -> None:
        for message in messages:
            send(stubs[u], spec.round_id, spec.purpose, message, timeout=1.0)

    for u, half in halves.items():
        sent(u, half.start(torch.tensor(PRESENT[u], dtype=torch.float64)))
    while not isinstance(out := aggregator.close(), Released):
        for u, step in out.items():
            sent(u, halves[u].step(over_the_wire(step)))
    return out, halves


@pytest.mark.parametrize(
    ("lost", "recomputing"),
    [
        ({}, SILOS),
        ({"silo-d": MaskedInput}, SILOS[:3]),  # not counted: its mask key is rebuilt
        ({"silo-d": ConsistencySignature}, SILOS[:3]),  # counted, but it never saw the others sign
        ({"silo-d": Reveal}, SILOS),  # it saw everyone sign, so it gets the transcript
    ],
    ids=["none", "a masked input", "a consistency signature", "a reveal"],
)
def test_every_silo_that_verified_the_consistency_round_recomputes_the_census_over_the_wire(
    lost, recomputing
):
    released, halves = census(lost)
    counted = SILOS[:3] if lost.get("silo-d") is MaskedInput else SILOS
    assert released.survivors == counted
    truth = np.sum([PRESENT[u] for u in counted], axis=0)
    assert torch.equal(released.total, torch.tensor(truth, dtype=torch.float64))
    for u in recomputing:
        assert halves[u].done
        assert torch.equal(halves[u].result, released.total), u
    for u in set(SILOS) - set(recomputing):
        assert not halves[u].done
        with pytest.raises(ProtocolViolation, match="before its transcript"):
            _ = halves[u].result


def test_a_census_masked_input_without_its_signature_in_the_submit_header_is_refused():
    aggregator, halves = halves_of(SumSpec("r1.a1", "census", SILOS, census_schema(CLASSES)))
    for u, half in halves.items():
        aggregator.receive(u, *half.start(torch.tensor(PRESENT[u], dtype=torch.float64)))
    for u, step in aggregator.close().items():
        aggregator.receive(u, *halves[u].step(step))
    inboxes = aggregator.close()
    masked = halves["silo-a"].step(inboxes["silo-a"])[0]
    assert masked.signature
    stream = list(
        submit_stream("r1.a1", masked_payload(masked), kind=pb.CONTRIBUTION_KIND_MASKED, purpose="census")
    )
    unsigned = submitted(stream[0].header, b"".join(p.chunk for p in stream[1:]), layer="secagg")
    with pytest.raises(ProtocolViolation, match="silo-a: signature does not verify"):
        aggregator.receive("silo-a", unsigned)


def test_a_transcript_that_lists_a_silo_twice_is_refused_as_it_is_read():
    twice = pb.SignedMaskedInput(silo_id="silo-a", masked=bytes(4 * CLASSES), signature=b"signed")
    step = pb.SumStep(
        round_id="r1.a1",
        sum=pb.SECURE_SUM_CENSUS,
        transcript=pb.SecAggTranscript(masked_inputs=[twice, twice]),
    )
    with pytest.raises(ProtocolViolation, match="lists a silo twice"):
        step_from_pb(step, layer="secagg")
