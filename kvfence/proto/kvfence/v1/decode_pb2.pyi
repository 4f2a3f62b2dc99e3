from kvfence.proto.kvfence.v1 import common_pb2 as _common_pb2
from kvfence.proto.kvfence.v1 import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "tenant_id", "prompt_tokens", "max_new_tokens", "scrub_on_free")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCRUB_ON_FREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    prompt_tokens: int
    max_new_tokens: int
    scrub_on_free: bool
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., scrub_on_free: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "tenant_id", "reservation_id", "manifest", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    reservation_id: str
    manifest: _common_pb2.KvManifest
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., manifest: _Optional[_Union[_common_pb2.KvManifest, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("verified", "token_ids", "finish_reason")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    verified: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    def __init__(self, verified: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ...) -> None: ...
