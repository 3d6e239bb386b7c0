"""A contribution as a Submit stream: a header naming its round, kind and SHA-256, then chunks of 1 MiB."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from fedlt.v1 import consortium_pb2 as pb

CHUNK = 1 << 20


def submit_stream(
    round_id: str, payload: bytes, *, kind: int, secure_sum: int = 0
) -> Iterator[pb.SubmitRequest]:
    header = pb.SubmitHeader(
        round_id=round_id,
        kind=kind,
        total_bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        sum=secure_sum,
    )
    yield pb.SubmitRequest(header=header)
    for offset in range(0, len(payload), CHUNK):
        yield pb.SubmitRequest(chunk=payload[offset : offset + CHUNK])
