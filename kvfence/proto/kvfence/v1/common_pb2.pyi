from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(_message.Message):
    __slots__ = ("page_size", "dtype", "num_layers", "num_kv_heads", "head_dim")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class PageRef(_message.Message):
    __slots__ = ("page_id", "generation")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    generation: int
    def __init__(self, page_id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ManifestPage(_message.Message):
    __slots__ = ("page_id", "generation", "tokens_in_page", "checksum")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_PAGE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    generation: int
    tokens_in_page: int
    checksum: int
    def __init__(self, page_id: _Optional[int] = ..., generation: _Optional[int] = ..., tokens_in_page: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class KvManifest(_message.Message):
    __slots__ = ("request_id", "tenant_id", "reservation_id", "model_fingerprint", "layout", "token_count", "first_token", "pages", "checksum_algo", "mac")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant_id: str
    reservation_id: str
    model_fingerprint: str
    layout: KvLayout
    token_count: int
    first_token: int
    pages: _containers.RepeatedCompositeFieldContainer[ManifestPage]
    checksum_algo: str
    mac: bytes
    def __init__(self, request_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., token_count: _Optional[int] = ..., first_token: _Optional[int] = ..., pages: _Optional[_Iterable[_Union[ManifestPage, _Mapping]]] = ..., checksum_algo: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...
