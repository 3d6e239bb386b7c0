from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiloStatus(_message.Message):
    __slots__ = ("silo_id", "connected", "last_seen_unix_ms", "activity", "last_contributed_round", "privacy_remaining", "refusal")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTRIBUTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_REMAINING_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    connected: bool
    last_seen_unix_ms: int
    activity: str
    last_contributed_round: int
    privacy_remaining: float
    refusal: SiloRefusal
    def __init__(self, silo_id: _Optional[str] = ..., connected: _Optional[bool] = ..., last_seen_unix_ms: _Optional[int] = ..., activity: _Optional[str] = ..., last_contributed_round: _Optional[int] = ..., privacy_remaining: _Optional[float] = ..., refusal: _Optional[_Union[SiloRefusal, _Mapping]] = ...) -> None: ...

class SiloRefusal(_message.Message):
    __slots__ = ("round_id", "code", "text", "at_unix_ms")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    code: str
    text: str
    at_unix_ms: int
    def __init__(self, round_id: _Optional[str] = ..., code: _Optional[str] = ..., text: _Optional[str] = ..., at_unix_ms: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("consortium_id", "method", "privacy", "committed_rounds", "total_rounds", "round_id", "stage", "stage_deadline_unix_ms", "participants", "submitted", "silos", "state_digest", "certificate_warnings")
    CONSORTIUM_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    SILOS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_WARNINGS_FIELD_NUMBER: _ClassVar[int]
    consortium_id: str
    method: str
    privacy: str
    committed_rounds: int
    total_rounds: int
    round_id: str
    stage: str
    stage_deadline_unix_ms: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    submitted: _containers.RepeatedScalarFieldContainer[str]
    silos: _containers.RepeatedCompositeFieldContainer[SiloStatus]
    state_digest: str
    certificate_warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, consortium_id: _Optional[str] = ..., method: _Optional[str] = ..., privacy: _Optional[str] = ..., committed_rounds: _Optional[int] = ..., total_rounds: _Optional[int] = ..., round_id: _Optional[str] = ..., stage: _Optional[str] = ..., stage_deadline_unix_ms: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., submitted: _Optional[_Iterable[str]] = ..., silos: _Optional[_Iterable[_Union[SiloStatus, _Mapping]]] = ..., state_digest: _Optional[str] = ..., certificate_warnings: _Optional[_Iterable[str]] = ...) -> None: ...
