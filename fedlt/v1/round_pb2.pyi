from fedlt.v1 import layer_pb2 as _layer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FieldSpec(_message.Message):
    __slots__ = ("name", "shape", "bound", "frac_bits", "per_class", "sensitivity", "float64", "inverts", "whole_roster")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    FRAC_BITS_FIELD_NUMBER: _ClassVar[int]
    PER_CLASS_FIELD_NUMBER: _ClassVar[int]
    SENSITIVITY_FIELD_NUMBER: _ClassVar[int]
    FLOAT64_FIELD_NUMBER: _ClassVar[int]
    INVERTS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_ROSTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    bound: float
    frac_bits: int
    per_class: bool
    sensitivity: float
    float64: bool
    inverts: bool
    whole_roster: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., bound: _Optional[float] = ..., frac_bits: _Optional[int] = ..., per_class: _Optional[bool] = ..., sensitivity: _Optional[float] = ..., float64: _Optional[bool] = ..., inverts: _Optional[bool] = ..., whole_roster: _Optional[bool] = ...) -> None: ...

class Schema(_message.Message):
    __slots__ = ("phase", "fields")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    def __init__(self, phase: _Optional[str] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ...) -> None: ...

class RoundSpec(_message.Message):
    __slots__ = ("consortium_id", "round", "attempt", "round_id", "method", "schema", "method_config", "config_sha256", "state_digest", "state_bytes", "seed", "privacy", "participants", "disclosures", "deadline_unix_ms", "secagg", "disclosers", "census", "ckks", "attestations", "layer_parameters")
    CONSORTIUM_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    METHOD_CONFIG_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    DISCLOSURES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    DISCLOSERS_FIELD_NUMBER: _ClassVar[int]
    CENSUS_FIELD_NUMBER: _ClassVar[int]
    CKKS_FIELD_NUMBER: _ClassVar[int]
    ATTESTATIONS_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    consortium_id: str
    round: int
    attempt: int
    round_id: str
    method: str
    schema: Schema
    method_config: str
    config_sha256: str
    state_digest: str
    state_bytes: int
    seed: int
    privacy: str
    participants: _containers.RepeatedScalarFieldContainer[str]
    disclosures: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix_ms: int
    secagg: SecAggParameters
    disclosers: _containers.RepeatedScalarFieldContainer[str]
    census: Census
    ckks: CkksParameters
    attestations: StateAttestations
    layer_parameters: _layer_pb2.Entries
    def __init__(self, consortium_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., round_id: _Optional[str] = ..., method: _Optional[str] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ..., method_config: _Optional[str] = ..., config_sha256: _Optional[str] = ..., state_digest: _Optional[str] = ..., state_bytes: _Optional[int] = ..., seed: _Optional[int] = ..., privacy: _Optional[str] = ..., participants: _Optional[_Iterable[str]] = ..., disclosures: _Optional[_Iterable[str]] = ..., deadline_unix_ms: _Optional[int] = ..., secagg: _Optional[_Union[SecAggParameters, _Mapping]] = ..., disclosers: _Optional[_Iterable[str]] = ..., census: _Optional[_Union[Census, _Mapping]] = ..., ckks: _Optional[_Union[CkksParameters, _Mapping]] = ..., attestations: _Optional[_Union[StateAttestations, _Mapping]] = ..., layer_parameters: _Optional[_Union[_layer_pb2.Entries, _Mapping]] = ...) -> None: ...

class StateAttestations(_message.Message):
    __slots__ = ("counted", "signatures")
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    counted: _containers.RepeatedScalarFieldContainer[str]
    signatures: _containers.RepeatedCompositeFieldContainer[StateSignature]
    def __init__(self, counted: _Optional[_Iterable[str]] = ..., signatures: _Optional[_Iterable[_Union[StateSignature, _Mapping]]] = ...) -> None: ...

class StateSignature(_message.Message):
    __slots__ = ("silo_id", "signature", "certificate")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    signature: bytes
    certificate: bytes
    def __init__(self, silo_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class Census(_message.Message):
    __slots__ = ("silos", "silos_per_class", "records_per_class")
    SILOS_FIELD_NUMBER: _ClassVar[int]
    SILOS_PER_CLASS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PER_CLASS_FIELD_NUMBER: _ClassVar[int]
    silos: _containers.RepeatedScalarFieldContainer[str]
    silos_per_class: _containers.RepeatedScalarFieldContainer[int]
    records_per_class: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, silos: _Optional[_Iterable[str]] = ..., silos_per_class: _Optional[_Iterable[int]] = ..., records_per_class: _Optional[_Iterable[int]] = ...) -> None: ...

class SecAggParameters(_message.Message):
    __slots__ = ("threshold", "neighbours", "k_min", "min_records")
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    MIN_RECORDS_FIELD_NUMBER: _ClassVar[int]
    threshold: int
    neighbours: int
    k_min: int
    min_records: int
    def __init__(self, threshold: _Optional[int] = ..., neighbours: _Optional[int] = ..., k_min: _Optional[int] = ..., min_records: _Optional[int] = ...) -> None: ...

class CkksParameters(_message.Message):
    __slots__ = ("k_min", "context_id", "key_holder", "min_records")
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_HOLDER_FIELD_NUMBER: _ClassVar[int]
    MIN_RECORDS_FIELD_NUMBER: _ClassVar[int]
    k_min: int
    context_id: str
    key_holder: str
    min_records: int
    def __init__(self, k_min: _Optional[int] = ..., context_id: _Optional[str] = ..., key_holder: _Optional[str] = ..., min_records: _Optional[int] = ...) -> None: ...

class SignedRoundSpec(_message.Message):
    __slots__ = ("spec", "signature")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    spec: bytes
    signature: bytes
    def __init__(self, spec: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
