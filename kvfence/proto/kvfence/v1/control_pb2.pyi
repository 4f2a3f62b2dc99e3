from kvfence.proto.kvfence.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "role", "grpc_address", "ucx_address", "model_fingerprint", "layout", "pool_tokens", "total_pages", "instance_id", "protocol_version", "kvfence_version", "text_fingerprint")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KVFENCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    grpc_address: str
    ucx_address: str
    model_fingerprint: str
    layout: _common_pb2.KvLayout
    pool_tokens: int
    total_pages: int
    instance_id: str
    protocol_version: int
    kvfence_version: str
    text_fingerprint: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., ucx_address: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., pool_tokens: _Optional[int] = ..., total_pages: _Optional[int] = ..., instance_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., kvfence_version: _Optional[str] = ..., text_fingerprint: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "reason", "heartbeat_interval_ms")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    heartbeat_interval_ms: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "free_pages", "quarantined_pages", "queue_length", "draining", "instance_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    free_pages: int
    quarantined_pages: int
    queue_length: int
    draining: bool
    instance_id: str
    def __init__(self, node_id: _Optional[str] = ..., free_pages: _Optional[int] = ..., quarantined_pages: _Optional[int] = ..., queue_length: _Optional[int] = ..., draining: _Optional[bool] = ..., instance_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "superseded")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    known: bool
    superseded: bool
    def __init__(self, known: _Optional[bool] = ..., superseded: _Optional[bool] = ...) -> None: ...

class TenantLimits(_message.Message):
    __slots__ = ("max_concurrent_requests", "max_tokens_per_request", "scrub_on_free")
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SCRUB_ON_FREE_FIELD_NUMBER: _ClassVar[int]
    max_concurrent_requests: int
    max_tokens_per_request: int
    scrub_on_free: bool
    def __init__(self, max_concurrent_requests: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ..., scrub_on_free: _Optional[bool] = ...) -> None: ...

class ApiKeyInfo(_message.Message):
    __slots__ = ("key_id", "revoked", "created_at")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    revoked: bool
    created_at: str
    def __init__(self, key_id: _Optional[str] = ..., revoked: _Optional[bool] = ..., created_at: _Optional[str] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "limits", "keys")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    name: str
    limits: TenantLimits
    keys: _containers.RepeatedCompositeFieldContainer[ApiKeyInfo]
    def __init__(self, name: _Optional[str] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ..., keys: _Optional[_Iterable[_Union[ApiKeyInfo, _Mapping]]] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("name", "limits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    limits: TenantLimits
    def __init__(self, name: _Optional[str] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ...) -> None: ...

class CreateTenantResponse(_message.Message):
    __slots__ = ("tenant", "api_key", "key_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    api_key: str
    key_id: str
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., api_key: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class CreateKeyRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class CreateKeyResponse(_message.Message):
    __slots__ = ("api_key", "key_id")
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    key_id: str
    def __init__(self, api_key: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class RevokeKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RevokeKeyResponse(_message.Message):
    __slots__ = ("revoked",)
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    def __init__(self, revoked: _Optional[bool] = ...) -> None: ...

class SetLimitsRequest(_message.Message):
    __slots__ = ("name", "limits", "fields")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    limits: TenantLimits
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., limits: _Optional[_Union[TenantLimits, _Mapping]] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "grpc_address", "ucx_address", "pool_tokens", "total_pages", "free_pages", "quarantined_pages", "healthy", "last_heartbeat_age_s", "layout", "draining", "kvfence_version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KVFENCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    grpc_address: str
    ucx_address: str
    pool_tokens: int
    total_pages: int
    free_pages: int
    quarantined_pages: int
    healthy: bool
    last_heartbeat_age_s: float
    layout: _common_pb2.KvLayout
    draining: bool
    kvfence_version: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., ucx_address: _Optional[str] = ..., pool_tokens: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., quarantined_pages: _Optional[int] = ..., healthy: _Optional[bool] = ..., last_heartbeat_age_s: _Optional[float] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., draining: _Optional[bool] = ..., kvfence_version: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "context_window", "admissible_limit")
    NODES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ADMISSIBLE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    context_window: int
    admissible_limit: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., context_window: _Optional[int] = ..., admissible_limit: _Optional[int] = ...) -> None: ...

class ModelStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "online", "reason", "context_window", "admissible_limit", "offline_since")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ADMISSIBLE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_SINCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    online: bool
    reason: str
    context_window: int
    admissible_limit: int
    offline_since: str
    def __init__(self, name: _Optional[str] = ..., online: _Optional[bool] = ..., reason: _Optional[str] = ..., context_window: _Optional[int] = ..., admissible_limit: _Optional[int] = ..., offline_since: _Optional[str] = ...) -> None: ...

class SetModelAccessRequest(_message.Message):
    __slots__ = ("online", "reason")
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    online: bool
    reason: str
    def __init__(self, online: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "tenant_id", "state", "prefill_node", "decode_node", "prompt_tokens", "max_new_tokens", "age_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    state: str
    prefill_node: str
    decode_node: str
    prompt_tokens: int
    max_new_tokens: int
    age_s: float
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., state: _Optional[str] = ..., prefill_node: _Optional[str] = ..., decode_node: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class CheckConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolCheck(_message.Message):
    __slots__ = ("node_id", "role", "pool_tokens", "ok", "message")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    pool_tokens: int
    ok: bool
    message: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., pool_tokens: _Optional[int] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class CheckConfigResponse(_message.Message):
    __slots__ = ("ok", "context_window", "admissible_limit", "clamped", "pools")
    OK_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ADMISSIBLE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CLAMPED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    context_window: int
    admissible_limit: int
    clamped: bool
    pools: _containers.RepeatedCompositeFieldContainer[PoolCheck]
    def __init__(self, ok: _Optional[bool] = ..., context_window: _Optional[int] = ..., admissible_limit: _Optional[int] = ..., clamped: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[PoolCheck, _Mapping]]] = ...) -> None: ...

class BackupTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackupTenantsChunk(_message.Message):
    __slots__ = ("data", "total_bytes", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
