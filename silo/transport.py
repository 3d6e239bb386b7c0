"""The silo's one door to the aggregator: every call a silo makes, on one session's channel, each bounded.

Only this module calls the consortium's service (the session, `silo.connection`, opens the channel, names its
study on it with `study_channel` and makes the stub). The agent's parts, the round's sums
(`silo.participation`), the server step (`silo.stepping`) and the key service (`silo.key_service`) are handed
a `SiloTransport` and speak in the project's messages; a layer's stage messages reach their RPC through
`privacy.wire`, which maps each message type to its call.

A silo taking part in several studies of one aggregator runs one agent per study (`silo.studies`), and each
names its study on every call of its channel (`fedlt.studies.STUDY_HEADER`): on the channel, not call by call,
so that no call of any part can go out without it. The aggregator routes by it and nothing else; the silo
keys nothing it guarantees on it (`fedlt.aggregation.gate`).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterator, Sequence

import grpc

from fedlt.studies import STUDY_HEADER
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import chunks
from privacy import wire

# Calls other than the directive stream must not hang forever on a silent network.
CALL_TIMEOUT = 120.0
HEARTBEAT_TIMEOUT = 10.0  # a heartbeat that cannot get through in this long ends the heartbeats


def study_channel(channel: grpc.Channel, study: str) -> grpc.Channel:
    """`channel` with every call carrying `study`'s header; `channel` itself for the aggregator's default
    study (`study` ""), whose calls carry none, as before studies existed."""
    return grpc.intercept_channel(channel, StudyHeader(study)) if study else channel


Details = grpc.ClientCallDetails
Continuation = Callable[[Details, object], object]
_Details = namedtuple(
    "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


class _CallDetails(_Details, grpc.ClientCallDetails):
    pass


class StudyHeader(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `fedlt-study: <study>` to a call's metadata, in place of any the call carried, for calls of
    every kind."""

    def __init__(self, study: str) -> None:
        self.study = study

    def _named(self, details: Details) -> _CallDetails:
        metadata = [(k, v) for k, v in details.metadata or () if k != STUDY_HEADER]
        return _CallDetails(
            details.method,
            details.timeout,
            [*metadata, (STUDY_HEADER, self.study)],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Continuation, client_call_details: Details, request: object
    ) -> object:
        return continuation(self._named(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Continuation, client_call_details: Details, request: object
    ) -> object:
        return continuation(self._named(client_call_details), request)

    def intercept_stream_unary(
        self, continuation: Continuation, client_call_details: Details, request_iterator: object
    ) -> object:
        return continuation(self._named(client_call_details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Continuation, client_call_details: Details, request_iterator: object
    ) -> object:
        return continuation(self._named(client_call_details), request_iterator)


class SiloTransport:
    """One session's calls to the aggregator, each under `timeout` (the directive stream lasts the session).
    `stub` is the session's `ConsortiumServiceStub`, or anything with its methods (the tests' aggregators)."""

    def __init__(self, stub: object, *, timeout: float = CALL_TIMEOUT) -> None:
        self._stub, self._timeout = stub, timeout

    # --- the session ---------------------------------------------------------------------------------------

    def register(self, request: pb.RegisterRequest) -> pb.RegisterResponse:
        return self._stub.Register(request, timeout=self._timeout)

    def join(self, last_round: int) -> Iterator[pb.JoinResponse]:
        """The directive stream, from the round after `last_round`; cancel it to end the session."""
        return self._stub.Join(pb.JoinRequest(last_round=last_round))

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return self._stub.Heartbeat(request, timeout=HEARTBEAT_TIMEOUT)

    # --- a round -------------------------------------------------------------------------------------------

    def fetch_state(self, round_id: str) -> Iterator[pb.FetchStateResponse]:
        """The round's starting state, as the aggregator streams it (its reader bounds it)."""
        return self._stub.FetchState(pb.FetchStateRequest(round_id=round_id), timeout=self._timeout)

    def refuse(self, round_id: str, *, code: int, text: str) -> None:
        self._stub.Refuse(pb.RefuseRequest(round_id=round_id, code=code, text=text), timeout=self._timeout)

    def disclose(self, round_id: str, *, name: str, shape: Sequence[int], values: bytes) -> str:
        """The disclosure sent; the sha256 the aggregator's receipt names."""
        request = pb.DiscloseRequest(round_id=round_id, name=name, shape=shape, values=values)
        return self._stub.Disclose(request, timeout=self._timeout).sha256

    def send(self, round_id: str, purpose: str, message: object) -> None:
        """One stage message of a sum, through whichever RPC carries its type."""
        wire.send(self._stub, round_id, purpose, message, timeout=self._timeout)

    def fetched(self, round_id: str, purpose: str, step: object) -> object:
        """A sum's step itself, or the payload it announces, downloaded and checked."""
        return wire.fetched(self._stub, round_id, purpose, step, timeout=self._timeout)

    def report_state(self, header: pb.StateReportHeader, sealed: bytes) -> None:
        """The next state this silo stepped to, sealed: the header, then the sealed bytes in chunks."""
        parts = [pb.ReportStateRequest(header=header)] + [
            pb.ReportStateRequest(chunk=c) for _, c in chunks(sealed)
        ]
        self._stub.ReportState(iter(parts), timeout=self._timeout)

    def report_evaluation(self, round_number: int, *, correct: Sequence[int], total: Sequence[int]) -> None:
        request = pb.ReportEvaluationRequest(round=round_number, correct=correct, total=total)
        self._stub.ReportEvaluation(request, timeout=self._timeout)

    # --- the key service -----------------------------------------------------------------------------------

    def enrollments(self) -> Sequence[pb.Enrollment]:
        """Every silo's enrollment key as the aggregator lists them (each checked by the caller)."""
        return self._stub.ListEnrollments(pb.ListEnrollmentsRequest(), timeout=self._timeout).enrollments

    def share_key(self, *, context_id: str, public_key: bytes, sealed: Sequence[pb.SealedContext]) -> None:
        request = pb.ShareKeyRequest(context_id=context_id, public_key=public_key, sealed=sealed)
        self._stub.ShareKey(request, timeout=self._timeout)

    def fetch_key(self, context_id: str) -> pb.FetchKeyResponse:
        """The key `context_id` sealed to this silo, and the certificate of the key holder that sealed it."""
        return self._stub.FetchKey(pb.FetchKeyRequest(context_id=context_id), timeout=self._timeout)
