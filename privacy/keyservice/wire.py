"""The key ceremony's messages in their Protobuf form (fedlt/v1), for silo and aggregator."""

from __future__ import annotations

from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import Mapped
from privacy.keyservice.ceremony import Announcement, SealedContext

SEALED = Mapped(SealedContext, pb.SealedContext, {"ephemeral": "ephemeral_key"})
ENROLLMENT = Mapped(Announcement, pb.Enrollment, {"silo": "silo_id", "public": "public_key"})
sealed_to_pb, sealed_from_pb = SEALED.to_pb, SEALED.from_pb
enrollment_to_pb, enrollment_from_pb = ENROLLMENT.to_pb, ENROLLMENT.from_pb
