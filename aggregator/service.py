"""Thin gRPC servicers over the round engine: who is calling (from the certificate), and status codes.

A caller's silo id is read from its client certificate (verified by TLS against the consortium CA, checked
here against the revocation list), never from a message field. Every refusal maps to a status code in one
table, `STATUS_OF`; anything unexpected becomes INTERNAL without leaking details to the caller.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import queue
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from aggregator.picking import BadDisclosure
from aggregator.rounds import (
    AlreadySubmitted,
    BadContribution,
    NotParticipant,
    Refusal,
    RoundEngine,
    WrongRound,
)
from aggregator.store import Store, now_ms
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, operator_pb2, operator_pb2_grpc
from privacy.pki.errors import PkiError
from privacy.pki.identity import RevocationList, load_certificate, operator_name_of, silo_id_of
from privacy.secagg import wire
from privacy.secagg.protocol import AdvertisedKeys, ProtocolViolation, StageError

log = logging.getLogger("aggregator.service")

CHUNK = 1 << 20


class Malformed(Refusal):
    """A malformed request (wrong order of stream parts, sizes that do not add up)."""


class Unauthenticated(Refusal):
    """No client certificate reached the handler."""


class Revoked(Refusal):
    """The client certificate is on the consortium's revocation list."""


class NotRegistered(Refusal):
    """A silo joined before registering."""


STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    WrongRound: grpc.StatusCode.FAILED_PRECONDITION,
    NotRegistered: grpc.StatusCode.FAILED_PRECONDITION,
    NotParticipant: grpc.StatusCode.PERMISSION_DENIED,
    Revoked: grpc.StatusCode.PERMISSION_DENIED,
    PkiError: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    BadContribution: grpc.StatusCode.INVALID_ARGUMENT,
    Malformed: grpc.StatusCode.INVALID_ARGUMENT,
    AlreadySubmitted: grpc.StatusCode.ALREADY_EXISTS,
    StageError: grpc.StatusCode.FAILED_PRECONDITION,
    ProtocolViolation: grpc.StatusCode.INVALID_ARGUMENT,
    BadDisclosure: grpc.StatusCode.INVALID_ARGUMENT,
}


def _abort_on_refusal(handler: Callable) -> Callable:
    """Map refusals to status codes; for streaming handlers this wraps the generator too."""

    def fail(context: grpc.ServicerContext, exc: Exception) -> None:
        for kind, code in STATUS_OF.items():
            if isinstance(exc, kind):
                context.abort(code, str(exc))
        log.exception("unexpected error in %s", handler.__name__)
        context.abort(grpc.StatusCode.INTERNAL, "internal error; see the aggregator's log")

    @functools.wraps(handler)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            result = handler(self, request, context)
        except Exception as exc:
            fail(context, exc)
        if not isinstance(result, Iterator):
            return result
        return _guarded(result, context, fail)

    return unary


def _guarded(stream: Iterator, context: grpc.ServicerContext, fail: Callable) -> Iterator:
    try:
        yield from stream
    except Exception as exc:
        fail(context, exc)


class Identity:
    """Reads the verified peer certificate and refuses revoked ones; the CRL is re-read when it changes."""

    def __init__(self, revocations: RevocationList) -> None:
        self.revocations = revocations

    def certificate(self, context: grpc.ServicerContext) -> Any:
        pems = context.auth_context().get("x509_pem_cert")
        if not pems:
            raise Unauthenticated("a consortium client certificate is required")
        cert = load_certificate(pems[0])
        self.revocations.reload()
        if self.revocations.is_revoked(cert):
            raise Revoked("this certificate has been revoked by the consortium operator")
        return cert

    def silo(self, context: grpc.ServicerContext) -> str:
        return silo_id_of(self.certificate(context))


class ConsortiumServicer(consortium_pb2_grpc.ConsortiumServiceServicer):
    def __init__(self, engine: RoundEngine, store: Store, identity: Identity, aggregator_pem: bytes) -> None:
        self.engine = engine
        self.store = store
        self.identity = identity
        self.aggregator_pem = aggregator_pem

    @_abort_on_refusal
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        cert = self.identity.certificate(context)
        silo = silo_id_of(cert)
        policy = {
            "methods": list(request.accepted_methods),
            "privacy": list(request.accepted_privacy),
            "disclosures": list(request.accepted_disclosures),
        }
        fingerprint = hashlib.sha256(context.auth_context()["x509_pem_cert"][0]).hexdigest()
        self.store.register_silo(silo, fingerprint, request.agent_version[:64], policy)
        return pb.RegisterResponse(
            silo_id=silo,
            consortium_id=self.engine.config.consortium.id,
            aggregator_certificate=self.aggregator_pem,
        )

    @_abort_on_refusal
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Iterator[pb.JoinResponse]:
        silo = self.identity.silo(context)
        if silo not in self.store.silos():
            raise NotRegistered("call Register before Join")
        session = self.engine.connect(silo)
        context.add_callback(lambda: self.engine.disconnect(session))
        return self._directives(session, context)

    def _directives(self, session: Any, context: grpc.ServicerContext) -> Iterator[pb.JoinResponse]:
        while context.is_active() and not session.closed:
            try:
                directive = session.directives.get(timeout=1.0)
            except queue.Empty:
                continue
            if directive is None:
                return
            yield directive
            if directive.HasField("finished"):
                return

    @_abort_on_refusal
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        silo = self.identity.silo(context)
        self.engine.heartbeat(
            silo, pb.SiloActivity.Name(request.activity).removeprefix("SILO_ACTIVITY_").lower()
        )
        self.store.touch_silo(silo)
        return pb.HeartbeatResponse(server_time_unix_ms=now_ms())

    @_abort_on_refusal
    def FetchState(self, request: pb.FetchStateRequest, context: grpc.ServicerContext) -> Iterator:
        data = self.engine.state_for(self.identity.silo(context), request.round_id)
        return (
            pb.FetchStateResponse(offset=offset, data=data[offset : offset + CHUNK])
            for offset in range(0, len(data), CHUNK)
        )

    @_abort_on_refusal
    def Submit(self, request_iterator: Iterator[pb.SubmitRequest], context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise Malformed("a Submit stream starts with a header")
        header = first.header
        kind = pb.CONTRIBUTION_KIND_MASKED if self.engine.secure else pb.CONTRIBUTION_KIND_PLAINTEXT
        if header.kind != kind:
            raise WrongRound(
                f"this consortium's rounds take {pb.ContributionKind.Name(kind)} contributions, "
                f"not {pb.ContributionKind.Name(header.kind)}"
            )
        purpose = _purpose(header.sum) if self.engine.secure else ""
        expected = self.engine.expected_bytes(silo, header.round_id, purpose)
        if header.total_bytes != expected:
            raise BadContribution(f"header announces {header.total_bytes} bytes; the schema needs {expected}")
        chunks, received, hasher = [], 0, hashlib.sha256()
        for part in request_iterator:
            if not part.HasField("chunk") or received + len(part.chunk) > expected:
                raise Malformed("after the header come only chunks, adding up to total_bytes")
            chunks.append(part.chunk)
            hasher.update(part.chunk)
            received += len(part.chunk)
        if received != expected:
            raise BadContribution(f"received {received} of {expected} bytes")
        digest = hasher.hexdigest()
        if digest != header.sha256:
            raise BadContribution("payload does not match the SHA-256 in its header")
        if self.engine.secure:
            self.engine.submit_masked(silo, header.round_id, purpose, b"".join(chunks), digest)
        else:
            self.engine.submit(silo, header.round_id, b"".join(chunks), digest)
        return pb.SubmitResponse(round_id=header.round_id, sha256=digest, accepted_unix_ms=now_ms())

    @_abort_on_refusal
    def Disclose(self, request: pb.DiscloseRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        shape = tuple(request.shape)
        digest = self.engine.disclose(silo, request.round_id, request.name, shape, request.values)
        return pb.DiscloseResponse(round_id=request.round_id, sha256=digest)

    @_abort_on_refusal
    def AdvertiseKeys(self, request: pb.AdvertiseKeysRequest, context: grpc.ServicerContext) -> Any:
        cert = self.identity.certificate(context)
        silo = silo_id_of(cert)
        keys = AdvertisedKeys(
            silo,
            request.c_public_key,
            request.s_public_key,
            request.signature,
            context.auth_context()["x509_pem_cert"][0],  # the certificate TLS verified, for peers to check
        )
        self.engine.secagg(silo, request.round_id, _purpose(request.sum), lambda s: s.add_keys(silo, keys))
        return pb.AdvertiseKeysResponse(round_id=request.round_id)

    @_abort_on_refusal
    def ShareKeys(self, request: pb.ShareKeysRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        envelopes = wire.envelopes_from_pb(request.shares)
        self.engine.secagg(
            silo, request.round_id, _purpose(request.sum), lambda s: s.add_envelopes(silo, envelopes)
        )
        return pb.ShareKeysResponse(round_id=request.round_id)

    @_abort_on_refusal
    def Consistency(self, request: pb.ConsistencyRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        self.engine.secagg(
            silo, request.round_id, _purpose(request.sum), lambda s: s.add_signature(silo, request.signature)
        )
        return pb.ConsistencyResponse(round_id=request.round_id)

    @_abort_on_refusal
    def Unmask(self, request: pb.UnmaskRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        reveal = wire.reveal_from_pb(request)
        self.engine.secagg(
            silo, request.round_id, _purpose(request.sum), lambda s: s.add_reveal(silo, reveal)
        )
        return pb.UnmaskResponse(round_id=request.round_id)


def _purpose(secure_sum: int) -> str:
    if secure_sum not in wire.PURPOSE_OF_SUM:
        raise Malformed("a secure-aggregation message names its sum (census or contribution)")
    return wire.PURPOSE_OF_SUM[secure_sum]


def _no_such_stage(name: str) -> Callable:
    """Stage RPCs of the secure layers; a round of another privacy layer has no such stage."""

    @_abort_on_refusal
    def handler(self: ConsortiumServicer, _request: Any, context: grpc.ServicerContext) -> Any:
        self.identity.silo(context)
        privacy = self.engine.config.consortium.privacy
        raise WrongRound(
            f"this consortium's rounds use the {privacy!r} privacy layer, which has no {name} stage"
        )

    handler.__name__ = name
    return handler


for _stage in ("ShareCkksContext", "FetchEncryptedSum"):
    setattr(ConsortiumServicer, _stage, _no_such_stage(_stage))


class OperatorServicer(operator_pb2_grpc.OperatorServiceServicer):
    def __init__(self, engine: RoundEngine, identity: Identity) -> None:
        self.engine = engine
        self.identity = identity

    @_abort_on_refusal
    def Status(self, request: operator_pb2.StatusRequest, context: grpc.ServicerContext) -> Any:
        operator_name_of(self.identity.certificate(context))
        status = self.engine.status()
        config = self.engine.config
        return operator_pb2.StatusResponse(
            consortium_id=config.consortium.id,
            method=config.plan.method.name,
            privacy=config.consortium.privacy,
            committed_rounds=status["committed_rounds"],
            total_rounds=self.engine.total_rounds,
            round_id=status["round_id"],
            stage=status["stage"],
            stage_deadline_unix_ms=status["deadline_ms"],
            participants=status["participants"],
            submitted=status["submitted"],
            silos=[operator_pb2.SiloStatus(**silo) for silo in status["silos"]],
            state_digest=status["state_digest"],
        )
