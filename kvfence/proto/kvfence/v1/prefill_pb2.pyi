from kvfence.proto.kvfence.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "decode_node_id", "decode_ucx_address", "pages", "secret", "prompt_tokens", "max_new_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    decode_node_id: str
    decode_ucx_address: str
    pages: _containers.RepeatedCompositeFieldContainer[_common_pb2.PageRef]
    secret: bytes
    prompt_tokens: int
    max_new_tokens: int
    def __init__(self, reservation_id: _Optional[str] = ..., decode_node_id: _Optional[str] = ..., decode_ucx_address: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[_common_pb2.PageRef, _Mapping]]] = ..., secret: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "tenant_id", "prompt_token_ids", "sampling", "reservation", "scrub_on_free")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    SCRUB_ON_FREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    reservation: Reservation
    scrub_on_free: bool
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., scrub_on_free: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("manifest", "pages_sent", "bytes_sent")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.KvManifest
    pages_sent: int
    bytes_sent: int
    def __init__(self, manifest: _Optional[_Union[_common_pb2.KvManifest, _Mapping]] = ..., pages_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node_id", "role", "total_pages", "free_pages", "quarantined_pages", "held_pages", "rpc_count", "active_requests")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    RPC_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    total_pages: int
    free_pages: int
    quarantined_pages: int
    held_pages: int
    rpc_count: int
    active_requests: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., quarantined_pages: _Optional[int] = ..., held_pages: _Optional[int] = ..., rpc_count: _Optional[int] = ..., active_requests: _Optional[int] = ...) -> None: ...
