from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HelloRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("node_id", "instance", "bulk_port", "replicas")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    instance: str
    bulk_port: int
    replicas: int
    def __init__(self, node_id: _Optional[str] = ..., instance: _Optional[str] = ..., bulk_port: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class CatalogRequest(_message.Message):
    __slots__ = ("job", "node_id", "since_version", "since_instance")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SINCE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    since_version: int
    since_instance: str
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., since_version: _Optional[int] = ..., since_instance: _Optional[str] = ...) -> None: ...

class RankKey(_message.Message):
    __slots__ = ("job", "step", "rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class CatalogEntry(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size", "owner", "generation", "bytes", "created_unix", "job_owner")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOB_OWNER_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    owner: str
    generation: str
    bytes: int
    created_unix: float
    job_owner: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., owner: _Optional[str] = ..., generation: _Optional[str] = ..., bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., job_owner: _Optional[str] = ...) -> None: ...

class CatalogResponse(_message.Message):
    __slots__ = ("node_id", "instance", "bulk_port", "entries", "version", "delta", "removed", "now_unix")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    instance: str
    bulk_port: int
    entries: _containers.RepeatedCompositeFieldContainer[CatalogEntry]
    version: int
    delta: bool
    removed: _containers.RepeatedCompositeFieldContainer[RankKey]
    now_unix: float
    def __init__(self, node_id: _Optional[str] = ..., instance: _Optional[str] = ..., bulk_port: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[CatalogEntry, _Mapping]]] = ..., version: _Optional[int] = ..., delta: _Optional[bool] = ..., removed: _Optional[_Iterable[_Union[RankKey, _Mapping]]] = ..., now_unix: _Optional[float] = ...) -> None: ...

class PrepareReplicaRequest(_message.Message):
    __slots__ = ("sender", "manifest_json", "skips_linked")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    SKIPS_LINKED_FIELD_NUMBER: _ClassVar[int]
    sender: str
    manifest_json: str
    skips_linked: bool
    def __init__(self, sender: _Optional[str] = ..., manifest_json: _Optional[str] = ..., skips_linked: _Optional[bool] = ...) -> None: ...

class PrepareReplicaResponse(_message.Message):
    __slots__ = ("already_committed", "ticket", "bulk_port", "linked")
    ALREADY_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    LINKED_FIELD_NUMBER: _ClassVar[int]
    already_committed: bool
    ticket: str
    bulk_port: int
    linked: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, already_committed: _Optional[bool] = ..., ticket: _Optional[str] = ..., bulk_port: _Optional[int] = ..., linked: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitReplicaRequest(_message.Message):
    __slots__ = ("ticket", "sender")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    sender: str
    def __init__(self, ticket: _Optional[str] = ..., sender: _Optional[str] = ...) -> None: ...

class CommitReplicaResponse(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class AbortReplicaRequest(_message.Message):
    __slots__ = ("ticket", "sender")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    sender: str
    def __init__(self, ticket: _Optional[str] = ..., sender: _Optional[str] = ...) -> None: ...

class AbortReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmReplicaRequest(_message.Message):
    __slots__ = ("sender", "job", "rank", "sizes")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sender: str
    job: str
    rank: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sender: _Optional[str] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmReplicaResponse(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class OpenReadRequest(_message.Message):
    __slots__ = ("requester", "job", "step", "rank")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    step: int
    rank: int
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class OpenReadResponse(_message.Message):
    __slots__ = ("manifest_json", "ticket", "bulk_port")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    ticket: str
    bulk_port: int
    def __init__(self, manifest_json: _Optional[str] = ..., ticket: _Optional[str] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class DropReplicasRequest(_message.Message):
    __slots__ = ("owner", "job", "step", "ranks", "reason", "requester")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    job: str
    step: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    requester: str
    def __init__(self, owner: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., requester: _Optional[str] = ...) -> None: ...

class DropReplicasResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class DeleteStepCopiesRequest(_message.Message):
    __slots__ = ("requester", "job", "step", "has_job_owner", "job_owner")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_JOB_OWNER_FIELD_NUMBER: _ClassVar[int]
    JOB_OWNER_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    step: int
    has_job_owner: bool
    job_owner: str
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., has_job_owner: _Optional[bool] = ..., job_owner: _Optional[str] = ...) -> None: ...

class DeleteStepCopiesResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class VerifyCopiesRequest(_message.Message):
    __slots__ = ("requester", "job", "has_step", "step")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    has_step: bool
    step: int
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class VerifiedCopy(_message.Message):
    __slots__ = ("step", "rank", "state", "detail")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    state: int
    detail: str
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., state: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class VerifyCopiesResponse(_message.Message):
    __slots__ = ("copies",)
    COPIES_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[VerifiedCopy]
    def __init__(self, copies: _Optional[_Iterable[_Union[VerifiedCopy, _Mapping]]] = ...) -> None: ...

class ProtectRankRequest(_message.Message):
    __slots__ = ("sender", "manifest_json", "chunk", "chunks", "row", "lane", "parity_k", "parity_m")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PARITY_K_FIELD_NUMBER: _ClassVar[int]
    PARITY_M_FIELD_NUMBER: _ClassVar[int]
    sender: str
    manifest_json: str
    chunk: int
    chunks: int
    row: int
    lane: str
    parity_k: int
    parity_m: int
    def __init__(self, sender: _Optional[str] = ..., manifest_json: _Optional[str] = ..., chunk: _Optional[int] = ..., chunks: _Optional[int] = ..., row: _Optional[int] = ..., lane: _Optional[str] = ..., parity_k: _Optional[int] = ..., parity_m: _Optional[int] = ...) -> None: ...

class ProtectRankResponse(_message.Message):
    __slots__ = ("already", "parity_bytes", "lane")
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    PARITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    already: bool
    parity_bytes: int
    lane: str
    def __init__(self, already: _Optional[bool] = ..., parity_bytes: _Optional[int] = ..., lane: _Optional[str] = ...) -> None: ...

class ReadRankRangeRequest(_message.Message):
    __slots__ = ("requester", "job", "step", "rank", "generation", "offset", "length")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    step: int
    rank: int
    generation: str
    offset: int
    length: int
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., generation: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class DataPiece(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class RebuildChunkRequest(_message.Message):
    __slots__ = ("requester", "job", "step", "rank", "owner", "generation", "chunk")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    step: int
    rank: int
    owner: str
    generation: str
    chunk: int
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., owner: _Optional[str] = ..., generation: _Optional[str] = ..., chunk: _Optional[int] = ...) -> None: ...

class OpenSlotReadResponse(_message.Message):
    __slots__ = ("ticket", "bulk_port", "size", "checksum", "members")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    bulk_port: int
    size: int
    checksum: str
    members: _containers.RepeatedCompositeFieldContainer[ProtectedRank]
    def __init__(self, ticket: _Optional[str] = ..., bulk_port: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[str] = ..., members: _Optional[_Iterable[_Union[ProtectedRank, _Mapping]]] = ...) -> None: ...

class ParityLookupRequest(_message.Message):
    __slots__ = ("requester", "job", "has_step", "step", "has_rank", "rank", "parity_k", "parity_m", "all_shapes")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARITY_K_FIELD_NUMBER: _ClassVar[int]
    PARITY_M_FIELD_NUMBER: _ClassVar[int]
    ALL_SHAPES_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    has_step: bool
    step: int
    has_rank: bool
    rank: int
    parity_k: int
    parity_m: int
    all_shapes: bool
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ..., has_rank: _Optional[bool] = ..., rank: _Optional[int] = ..., parity_k: _Optional[int] = ..., parity_m: _Optional[int] = ..., all_shapes: _Optional[bool] = ...) -> None: ...

class ProtectedRank(_message.Message):
    __slots__ = ("manifest_json", "chunk", "chunks", "parity_rows", "stripe", "lane", "row", "parity_k", "parity_m")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PARITY_ROWS_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    PARITY_K_FIELD_NUMBER: _ClassVar[int]
    PARITY_M_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    chunk: int
    chunks: int
    parity_rows: int
    stripe: int
    lane: str
    row: int
    parity_k: int
    parity_m: int
    def __init__(self, manifest_json: _Optional[str] = ..., chunk: _Optional[int] = ..., chunks: _Optional[int] = ..., parity_rows: _Optional[int] = ..., stripe: _Optional[int] = ..., lane: _Optional[str] = ..., row: _Optional[int] = ..., parity_k: _Optional[int] = ..., parity_m: _Optional[int] = ...) -> None: ...

class ReadParityRowRequest(_message.Message):
    __slots__ = ("requester", "job", "step", "stripe", "lane", "row")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    step: int
    stripe: int
    lane: str
    row: int
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., stripe: _Optional[int] = ..., lane: _Optional[str] = ..., row: _Optional[int] = ...) -> None: ...

class ParityLookupResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[ProtectedRank]
    def __init__(self, ranks: _Optional[_Iterable[_Union[ProtectedRank, _Mapping]]] = ...) -> None: ...

class DropParityRequest(_message.Message):
    __slots__ = ("requester", "job", "step")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    requester: str
    job: str
    step: int
    def __init__(self, requester: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class DropParityResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...
