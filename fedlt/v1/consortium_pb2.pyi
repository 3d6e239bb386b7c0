from fedlt.v1 import layer_pb2 as _layer_pb2
from fedlt.v1 import round_pb2 as _round_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SecureSum(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SECURE_SUM_UNSPECIFIED: _ClassVar[SecureSum]
    SECURE_SUM_CENSUS: _ClassVar[SecureSum]
    SECURE_SUM_CONTRIBUTION: _ClassVar[SecureSum]
    SECURE_SUM_EVALUATION: _ClassVar[SecureSum]

class SiloActivity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SILO_ACTIVITY_UNSPECIFIED: _ClassVar[SiloActivity]
    SILO_ACTIVITY_IDLE: _ClassVar[SiloActivity]
    SILO_ACTIVITY_FETCHING: _ClassVar[SiloActivity]
    SILO_ACTIVITY_TRAINING: _ClassVar[SiloActivity]
    SILO_ACTIVITY_UPLOADING: _ClassVar[SiloActivity]

class ContributionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTRIBUTION_KIND_UNSPECIFIED: _ClassVar[ContributionKind]
    CONTRIBUTION_KIND_PLAINTEXT: _ClassVar[ContributionKind]
    CONTRIBUTION_KIND_MASKED: _ClassVar[ContributionKind]
    CONTRIBUTION_KIND_CKKS: _ClassVar[ContributionKind]
    CONTRIBUTION_KIND_LAYER: _ClassVar[ContributionKind]

class RefusalCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_CODE_UNSPECIFIED: _ClassVar[RefusalCode]
    REFUSAL_CODE_POLICY: _ClassVar[RefusalCode]
    REFUSAL_CODE_SIGNATURE: _ClassVar[RefusalCode]
    REFUSAL_CODE_PLAN: _ClassVar[RefusalCode]
    REFUSAL_CODE_DATA: _ClassVar[RefusalCode]
    REFUSAL_CODE_STATE: _ClassVar[RefusalCode]
    REFUSAL_CODE_BUDGET: _ClassVar[RefusalCode]
    REFUSAL_CODE_OTHER: _ClassVar[RefusalCode]
SECURE_SUM_UNSPECIFIED: SecureSum
SECURE_SUM_CENSUS: SecureSum
SECURE_SUM_CONTRIBUTION: SecureSum
SECURE_SUM_EVALUATION: SecureSum
SILO_ACTIVITY_UNSPECIFIED: SiloActivity
SILO_ACTIVITY_IDLE: SiloActivity
SILO_ACTIVITY_FETCHING: SiloActivity
SILO_ACTIVITY_TRAINING: SiloActivity
SILO_ACTIVITY_UPLOADING: SiloActivity
CONTRIBUTION_KIND_UNSPECIFIED: ContributionKind
CONTRIBUTION_KIND_PLAINTEXT: ContributionKind
CONTRIBUTION_KIND_MASKED: ContributionKind
CONTRIBUTION_KIND_CKKS: ContributionKind
CONTRIBUTION_KIND_LAYER: ContributionKind
REFUSAL_CODE_UNSPECIFIED: RefusalCode
REFUSAL_CODE_POLICY: RefusalCode
REFUSAL_CODE_SIGNATURE: RefusalCode
REFUSAL_CODE_PLAN: RefusalCode
REFUSAL_CODE_DATA: RefusalCode
REFUSAL_CODE_STATE: RefusalCode
REFUSAL_CODE_BUDGET: RefusalCode
REFUSAL_CODE_OTHER: RefusalCode

class RegisterRequest(_message.Message):
    __slots__ = ("agent_version", "accepted_methods", "accepted_privacy", "accepted_disclosures", "key_enrollment")
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_METHODS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PRIVACY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DISCLOSURES_FIELD_NUMBER: _ClassVar[int]
    KEY_ENROLLMENT_FIELD_NUMBER: _ClassVar[int]
    agent_version: str
    accepted_methods: _containers.RepeatedScalarFieldContainer[str]
    accepted_privacy: _containers.RepeatedScalarFieldContainer[str]
    accepted_disclosures: _containers.RepeatedScalarFieldContainer[str]
    key_enrollment: KeyEnrollment
    def __init__(self, agent_version: _Optional[str] = ..., accepted_methods: _Optional[_Iterable[str]] = ..., accepted_privacy: _Optional[_Iterable[str]] = ..., accepted_disclosures: _Optional[_Iterable[str]] = ..., key_enrollment: _Optional[_Union[KeyEnrollment, _Mapping]] = ...) -> None: ...

class KeyEnrollment(_message.Message):
    __slots__ = ("public_key", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("silo_id", "consortium_id", "aggregator_certificate", "roster", "crl", "key_holder", "key_layer")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    CONSORTIUM_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    CRL_FIELD_NUMBER: _ClassVar[int]
    KEY_HOLDER_FIELD_NUMBER: _ClassVar[int]
    KEY_LAYER_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    consortium_id: str
    aggregator_certificate: bytes
    roster: bytes
    crl: bytes
    key_holder: str
    key_layer: str
    def __init__(self, silo_id: _Optional[str] = ..., consortium_id: _Optional[str] = ..., aggregator_certificate: _Optional[bytes] = ..., roster: _Optional[bytes] = ..., crl: _Optional[bytes] = ..., key_holder: _Optional[str] = ..., key_layer: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("last_round",)
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    last_round: int
    def __init__(self, last_round: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("round_spec", "abort", "finished", "sum_step", "roster")
    ROUND_SPEC_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SUM_STEP_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    round_spec: _round_pb2.SignedRoundSpec
    abort: Abort
    finished: Finished
    sum_step: SumStep
    roster: bytes
    def __init__(self, round_spec: _Optional[_Union[_round_pb2.SignedRoundSpec, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., sum_step: _Optional[_Union[SumStep, _Mapping]] = ..., roster: _Optional[bytes] = ...) -> None: ...

class SumStep(_message.Message):
    __slots__ = ("round_id", "sum", "keys", "inbox", "survivors", "signatures", "census", "encrypted_sum", "transcript", "ckks_signatures", "layer")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INBOX_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    CENSUS_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_SUM_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    CKKS_SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    sum: SecureSum
    keys: KeyList
    inbox: ShareInbox
    survivors: SurvivorList
    signatures: ConsistencySignatures
    census: CensusResult
    encrypted_sum: EncryptedSumReady
    transcript: SecAggTranscript
    ckks_signatures: CkksSumSignatures
    layer: _layer_pb2.LayerMessage
    def __init__(self, round_id: _Optional[str] = ..., sum: _Optional[_Union[SecureSum, str]] = ..., keys: _Optional[_Union[KeyList, _Mapping]] = ..., inbox: _Optional[_Union[ShareInbox, _Mapping]] = ..., survivors: _Optional[_Union[SurvivorList, _Mapping]] = ..., signatures: _Optional[_Union[ConsistencySignatures, _Mapping]] = ..., census: _Optional[_Union[CensusResult, _Mapping]] = ..., encrypted_sum: _Optional[_Union[EncryptedSumReady, _Mapping]] = ..., transcript: _Optional[_Union[SecAggTranscript, _Mapping]] = ..., ckks_signatures: _Optional[_Union[CkksSumSignatures, _Mapping]] = ..., layer: _Optional[_Union[_layer_pb2.LayerMessage, _Mapping]] = ...) -> None: ...

class CkksSumSignatures(_message.Message):
    __slots__ = ("signatures",)
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    signatures: _containers.RepeatedCompositeFieldContainer[CkksSiloSignature]
    def __init__(self, signatures: _Optional[_Iterable[_Union[CkksSiloSignature, _Mapping]]] = ...) -> None: ...

class CkksSiloSignature(_message.Message):
    __slots__ = ("silo_id", "signature", "certificate")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    signature: bytes
    certificate: bytes
    def __init__(self, silo_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class EncryptedSumReady(_message.Message):
    __slots__ = ("survivors", "total_bytes", "sha256")
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    total_bytes: int
    sha256: str
    def __init__(self, survivors: _Optional[_Iterable[str]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class AdvertisedKeys(_message.Message):
    __slots__ = ("silo_id", "c_public_key", "s_public_key", "signature", "certificate")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    C_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    S_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    c_public_key: bytes
    s_public_key: bytes
    signature: bytes
    certificate: bytes
    def __init__(self, silo_id: _Optional[str] = ..., c_public_key: _Optional[bytes] = ..., s_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class KeyList(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[AdvertisedKeys]
    def __init__(self, keys: _Optional[_Iterable[_Union[AdvertisedKeys, _Mapping]]] = ...) -> None: ...

class ShareInbox(_message.Message):
    __slots__ = ("survivors", "shares")
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    shares: _containers.RepeatedCompositeFieldContainer[EncryptedShare]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ..., shares: _Optional[_Iterable[_Union[EncryptedShare, _Mapping]]] = ...) -> None: ...

class SurvivorList(_message.Message):
    __slots__ = ("survivors",)
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ...) -> None: ...

class SiloSignature(_message.Message):
    __slots__ = ("silo_id", "signature")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    signature: bytes
    def __init__(self, silo_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ConsistencySignatures(_message.Message):
    __slots__ = ("signatures",)
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    signatures: _containers.RepeatedCompositeFieldContainer[SiloSignature]
    def __init__(self, signatures: _Optional[_Iterable[_Union[SiloSignature, _Mapping]]] = ...) -> None: ...

class SignedMaskedInput(_message.Message):
    __slots__ = ("silo_id", "masked", "signature")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    masked: bytes
    signature: bytes
    def __init__(self, silo_id: _Optional[str] = ..., masked: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SignedReveal(_message.Message):
    __slots__ = ("silo_id", "self_mask_shares", "mask_key_shares", "signature")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    self_mask_shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    mask_key_shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    signature: bytes
    def __init__(self, silo_id: _Optional[str] = ..., self_mask_shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ..., mask_key_shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SecAggTranscript(_message.Message):
    __slots__ = ("masked_inputs", "reveals")
    MASKED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    REVEALS_FIELD_NUMBER: _ClassVar[int]
    masked_inputs: _containers.RepeatedCompositeFieldContainer[SignedMaskedInput]
    reveals: _containers.RepeatedCompositeFieldContainer[SignedReveal]
    def __init__(self, masked_inputs: _Optional[_Iterable[_Union[SignedMaskedInput, _Mapping]]] = ..., reveals: _Optional[_Iterable[_Union[SignedReveal, _Mapping]]] = ...) -> None: ...

class CensusResult(_message.Message):
    __slots__ = ("silos_per_class",)
    SILOS_PER_CLASS_FIELD_NUMBER: _ClassVar[int]
    silos_per_class: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, silos_per_class: _Optional[_Iterable[int]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("round_id", "reason")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    reason: str
    def __init__(self, round_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("rounds", "state_digest")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    state_digest: str
    def __init__(self, rounds: _Optional[int] = ..., state_digest: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("round_id", "activity", "privacy_remaining", "roster_sha256", "crl_sha256")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_REMAINING_FIELD_NUMBER: _ClassVar[int]
    ROSTER_SHA256_FIELD_NUMBER: _ClassVar[int]
    CRL_SHA256_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    activity: SiloActivity
    privacy_remaining: float
    roster_sha256: str
    crl_sha256: str
    def __init__(self, round_id: _Optional[str] = ..., activity: _Optional[_Union[SiloActivity, str]] = ..., privacy_remaining: _Optional[float] = ..., roster_sha256: _Optional[str] = ..., crl_sha256: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("server_time_unix_ms", "roster", "crl")
    SERVER_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    CRL_FIELD_NUMBER: _ClassVar[int]
    server_time_unix_ms: int
    roster: bytes
    crl: bytes
    def __init__(self, server_time_unix_ms: _Optional[int] = ..., roster: _Optional[bytes] = ..., crl: _Optional[bytes] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class FetchStateResponse(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitHeader(_message.Message):
    __slots__ = ("round_id", "kind", "total_bytes", "sha256", "sum", "signature", "message_type")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    kind: ContributionKind
    total_bytes: int
    sha256: str
    sum: SecureSum
    signature: bytes
    message_type: str
    def __init__(self, round_id: _Optional[str] = ..., kind: _Optional[_Union[ContributionKind, str]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., sum: _Optional[_Union[SecureSum, str]] = ..., signature: _Optional[bytes] = ..., message_type: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("round_id", "sha256", "accepted_unix_ms")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    sha256: str
    accepted_unix_ms: int
    def __init__(self, round_id: _Optional[str] = ..., sha256: _Optional[str] = ..., accepted_unix_ms: _Optional[int] = ...) -> None: ...

class DiscloseRequest(_message.Message):
    __slots__ = ("round_id", "name", "shape", "values")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    def __init__(self, round_id: _Optional[str] = ..., name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ...) -> None: ...

class DiscloseResponse(_message.Message):
    __slots__ = ("round_id", "sha256")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    sha256: str
    def __init__(self, round_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class AdvertiseKeysRequest(_message.Message):
    __slots__ = ("round_id", "c_public_key", "s_public_key", "signature", "sum")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    C_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    S_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    c_public_key: bytes
    s_public_key: bytes
    signature: bytes
    sum: SecureSum
    def __init__(self, round_id: _Optional[str] = ..., c_public_key: _Optional[bytes] = ..., s_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., sum: _Optional[_Union[SecureSum, str]] = ...) -> None: ...

class AdvertiseKeysResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class EncryptedShare(_message.Message):
    __slots__ = ("sender", "recipient", "ciphertext")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    sender: str
    recipient: str
    ciphertext: bytes
    def __init__(self, sender: _Optional[str] = ..., recipient: _Optional[str] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class ShareKeysRequest(_message.Message):
    __slots__ = ("round_id", "shares", "sum")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    shares: _containers.RepeatedCompositeFieldContainer[EncryptedShare]
    sum: SecureSum
    def __init__(self, round_id: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[EncryptedShare, _Mapping]]] = ..., sum: _Optional[_Union[SecureSum, str]] = ...) -> None: ...

class ShareKeysResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("round_id", "sum", "message")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    sum: SecureSum
    message: _layer_pb2.LayerMessage
    def __init__(self, round_id: _Optional[str] = ..., sum: _Optional[_Union[SecureSum, str]] = ..., message: _Optional[_Union[_layer_pb2.LayerMessage, _Mapping]] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class ConsistencyRequest(_message.Message):
    __slots__ = ("round_id", "signature", "sum")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    signature: bytes
    sum: SecureSum
    def __init__(self, round_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., sum: _Optional[_Union[SecureSum, str]] = ...) -> None: ...

class ConsistencyResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class RevealedShare(_message.Message):
    __slots__ = ("owner", "share")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    share: bytes
    def __init__(self, owner: _Optional[str] = ..., share: _Optional[bytes] = ...) -> None: ...

class UnmaskRequest(_message.Message):
    __slots__ = ("round_id", "self_mask_shares", "mask_key_shares", "sum", "signature")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    self_mask_shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    mask_key_shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    sum: SecureSum
    signature: bytes
    def __init__(self, round_id: _Optional[str] = ..., self_mask_shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ..., mask_key_shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ..., sum: _Optional[_Union[SecureSum, str]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class UnmaskResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class ListEnrollmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Enrollment(_message.Message):
    __slots__ = ("silo_id", "public_key", "signature", "certificate")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    public_key: bytes
    signature: bytes
    certificate: bytes
    def __init__(self, silo_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class ListEnrollmentsResponse(_message.Message):
    __slots__ = ("enrollments",)
    ENROLLMENTS_FIELD_NUMBER: _ClassVar[int]
    enrollments: _containers.RepeatedCompositeFieldContainer[Enrollment]
    def __init__(self, enrollments: _Optional[_Iterable[_Union[Enrollment, _Mapping]]] = ...) -> None: ...

class SealedContext(_message.Message):
    __slots__ = ("sender", "recipient", "context_id", "ephemeral_key", "ciphertext", "signature")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_KEY_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    sender: str
    recipient: str
    context_id: str
    ephemeral_key: bytes
    ciphertext: bytes
    signature: bytes
    def __init__(self, sender: _Optional[str] = ..., recipient: _Optional[str] = ..., context_id: _Optional[str] = ..., ephemeral_key: _Optional[bytes] = ..., ciphertext: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ShareKeyRequest(_message.Message):
    __slots__ = ("context_id", "public_key", "sealed")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    public_key: bytes
    sealed: _containers.RepeatedCompositeFieldContainer[SealedContext]
    def __init__(self, context_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., sealed: _Optional[_Iterable[_Union[SealedContext, _Mapping]]] = ...) -> None: ...

class ShareKeyResponse(_message.Message):
    __slots__ = ("context_id",)
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    def __init__(self, context_id: _Optional[str] = ...) -> None: ...

class FetchKeyRequest(_message.Message):
    __slots__ = ("context_id",)
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    def __init__(self, context_id: _Optional[str] = ...) -> None: ...

class FetchKeyResponse(_message.Message):
    __slots__ = ("sealed", "holder_certificate")
    SEALED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    sealed: SealedContext
    holder_certificate: bytes
    def __init__(self, sealed: _Optional[_Union[SealedContext, _Mapping]] = ..., holder_certificate: _Optional[bytes] = ...) -> None: ...

class FetchSumRequest(_message.Message):
    __slots__ = ("round_id", "sum")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    sum: SecureSum
    def __init__(self, round_id: _Optional[str] = ..., sum: _Optional[_Union[SecureSum, str]] = ...) -> None: ...

class FetchSumResponse(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StateReportHeader(_message.Message):
    __slots__ = ("round_id", "state_digest", "total_bytes", "sha256", "next_schema", "remaining_rounds", "next_trains", "evaluation", "evaluation_kind", "state_signature", "round", "counted")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NEXT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REMAINING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TRAINS_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    state_digest: str
    total_bytes: int
    sha256: str
    next_schema: _round_pb2.Schema
    remaining_rounds: int
    next_trains: bool
    evaluation: bytes
    evaluation_kind: ContributionKind
    state_signature: bytes
    round: int
    counted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round_id: _Optional[str] = ..., state_digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., next_schema: _Optional[_Union[_round_pb2.Schema, _Mapping]] = ..., remaining_rounds: _Optional[int] = ..., next_trains: _Optional[bool] = ..., evaluation: _Optional[bytes] = ..., evaluation_kind: _Optional[_Union[ContributionKind, str]] = ..., state_signature: _Optional[bytes] = ..., round: _Optional[int] = ..., counted: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportStateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: StateReportHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[StateReportHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class ReportStateResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...

class ReportEvaluationRequest(_message.Message):
    __slots__ = ("round", "correct", "total")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    round: int
    correct: _containers.RepeatedScalarFieldContainer[int]
    total: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., correct: _Optional[_Iterable[int]] = ..., total: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportEvaluationResponse(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class RefuseRequest(_message.Message):
    __slots__ = ("round_id", "code", "text")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    code: RefusalCode
    text: str
    def __init__(self, round_id: _Optional[str] = ..., code: _Optional[_Union[RefusalCode, str]] = ..., text: _Optional[str] = ...) -> None: ...

class RefuseResponse(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: str
    def __init__(self, round_id: _Optional[str] = ...) -> None: ...
