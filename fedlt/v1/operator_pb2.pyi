from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ("study",)
    STUDY_FIELD_NUMBER: _ClassVar[int]
    study: str
    def __init__(self, study: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("consortium_id", "method", "privacy", "committed_rounds", "total_rounds", "round_id", "stage", "stage_deadline_unix_ms", "participants", "submitted", "silos", "state_digest", "certificate_warnings", "study", "studies", "dp_enabled")
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
    STUDY_FIELD_NUMBER: _ClassVar[int]
    STUDIES_FIELD_NUMBER: _ClassVar[int]
    DP_ENABLED_FIELD_NUMBER: _ClassVar[int]
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
    study: str
    studies: _containers.RepeatedCompositeFieldContainer[Study]
    dp_enabled: bool
    def __init__(self, consortium_id: _Optional[str] = ..., method: _Optional[str] = ..., privacy: _Optional[str] = ..., committed_rounds: _Optional[int] = ..., total_rounds: _Optional[int] = ..., round_id: _Optional[str] = ..., stage: _Optional[str] = ..., stage_deadline_unix_ms: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., submitted: _Optional[_Iterable[str]] = ..., silos: _Optional[_Iterable[_Union[SiloStatus, _Mapping]]] = ..., state_digest: _Optional[str] = ..., certificate_warnings: _Optional[_Iterable[str]] = ..., study: _Optional[str] = ..., studies: _Optional[_Iterable[_Union[Study, _Mapping]]] = ..., dp_enabled: _Optional[bool] = ...) -> None: ...

class Study(_message.Message):
    __slots__ = ("id", "state", "reason", "is_default", "queue_position", "method", "privacy", "committed_rounds", "total_rounds", "state_digest", "created_unix_ms", "changed_unix_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: str
    reason: str
    is_default: bool
    queue_position: int
    method: str
    privacy: str
    committed_rounds: int
    total_rounds: int
    state_digest: str
    created_unix_ms: int
    changed_unix_ms: int
    def __init__(self, id: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., is_default: _Optional[bool] = ..., queue_position: _Optional[int] = ..., method: _Optional[str] = ..., privacy: _Optional[str] = ..., committed_rounds: _Optional[int] = ..., total_rounds: _Optional[int] = ..., state_digest: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., changed_unix_ms: _Optional[int] = ...) -> None: ...

class CreateStudyRequest(_message.Message):
    __slots__ = ("id", "study_toml")
    ID_FIELD_NUMBER: _ClassVar[int]
    STUDY_TOML_FIELD_NUMBER: _ClassVar[int]
    id: str
    study_toml: str
    def __init__(self, id: _Optional[str] = ..., study_toml: _Optional[str] = ...) -> None: ...

class CreateStudyResponse(_message.Message):
    __slots__ = ("study",)
    STUDY_FIELD_NUMBER: _ClassVar[int]
    study: Study
    def __init__(self, study: _Optional[_Union[Study, _Mapping]] = ...) -> None: ...

class ListStudiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListStudiesResponse(_message.Message):
    __slots__ = ("studies",)
    STUDIES_FIELD_NUMBER: _ClassVar[int]
    studies: _containers.RepeatedCompositeFieldContainer[Study]
    def __init__(self, studies: _Optional[_Iterable[_Union[Study, _Mapping]]] = ...) -> None: ...

class PauseStudyRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class PauseStudyResponse(_message.Message):
    __slots__ = ("study",)
    STUDY_FIELD_NUMBER: _ClassVar[int]
    study: Study
    def __init__(self, study: _Optional[_Union[Study, _Mapping]] = ...) -> None: ...

class ResumeStudyRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ResumeStudyResponse(_message.Message):
    __slots__ = ("study",)
    STUDY_FIELD_NUMBER: _ClassVar[int]
    study: Study
    def __init__(self, study: _Optional[_Union[Study, _Mapping]] = ...) -> None: ...

class CancelStudyRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelStudyResponse(_message.Message):
    __slots__ = ("study",)
    STUDY_FIELD_NUMBER: _ClassVar[int]
    study: Study
    def __init__(self, study: _Optional[_Union[Study, _Mapping]] = ...) -> None: ...
