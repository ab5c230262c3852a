from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_LOCAL: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_PERSISTENT: _ClassVar[Tier]

class Transfer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_UNSPECIFIED: _ClassVar[Transfer]
    TRANSFER_SHARED_FS: _ClassVar[Transfer]
    TRANSFER_STREAM: _ClassVar[Transfer]

class CopyState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COPY_STATE_UNSPECIFIED: _ClassVar[CopyState]
    COPY_STATE_OK: _ClassVar[CopyState]
    COPY_STATE_MISMATCH: _ClassVar[CopyState]
    COPY_STATE_MISSING: _ClassVar[CopyState]
TIER_UNSPECIFIED: Tier
TIER_LOCAL: Tier
TIER_PEER: Tier
TIER_PERSISTENT: Tier
TRANSFER_UNSPECIFIED: Transfer
TRANSFER_SHARED_FS: Transfer
TRANSFER_STREAM: Transfer
COPY_STATE_UNSPECIFIED: CopyState
COPY_STATE_OK: CopyState
COPY_STATE_MISMATCH: CopyState
COPY_STATE_MISSING: CopyState

class ShardSpec(_message.Message):
    __slots__ = ("name", "size", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size", "shards", "transfer", "base_step", "unchanged", "base_generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    BASE_STEP_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    BASE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardSpec]
    transfer: Transfer
    base_step: int
    unchanged: _containers.RepeatedScalarFieldContainer[str]
    base_generation: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardSpec, _Mapping]]] = ..., transfer: _Optional[_Union[Transfer, str]] = ..., base_step: _Optional[int] = ..., unchanged: _Optional[_Iterable[str]] = ..., base_generation: _Optional[str] = ...) -> None: ...

class StagedShard(_message.Message):
    __slots__ = ("name", "path", "recycled", "shared")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECYCLED_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    recycled: bool
    shared: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., recycled: _Optional[bool] = ..., shared: _Optional[bool] = ...) -> None: ...

class BeginSaveResponse(_message.Message):
    __slots__ = ("save_id", "shards", "fs_token", "local_dir")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DIR_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    shards: _containers.RepeatedCompositeFieldContainer[StagedShard]
    fs_token: str
    local_dir: str
    def __init__(self, save_id: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[StagedShard, _Mapping]]] = ..., fs_token: _Optional[str] = ..., local_dir: _Optional[str] = ...) -> None: ...

class WriteShardRequest(_message.Message):
    __slots__ = ("save_id", "shard", "offset", "data")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    shard: str
    offset: int
    data: bytes
    def __init__(self, save_id: _Optional[str] = ..., shard: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteShardResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class ShardDigest(_message.Message):
    __slots__ = ("name", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    checksum: str
    def __init__(self, name: _Optional[str] = ..., checksum: _Optional[str] = ...) -> None: ...

class CommitSaveRequest(_message.Message):
    __slots__ = ("save_id", "digests", "metadata_json", "persist", "policy")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    digests: _containers.RepeatedCompositeFieldContainer[ShardDigest]
    metadata_json: str
    persist: bool
    policy: JobPolicy
    def __init__(self, save_id: _Optional[str] = ..., digests: _Optional[_Iterable[_Union[ShardDigest, _Mapping]]] = ..., metadata_json: _Optional[str] = ..., persist: _Optional[bool] = ..., policy: _Optional[_Union[JobPolicy, _Mapping]] = ...) -> None: ...

class CommitSaveResponse(_message.Message):
    __slots__ = ("bytes", "commit_seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    commit_seconds: float
    def __init__(self, bytes: _Optional[int] = ..., commit_seconds: _Optional[float] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("save_id",)
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    def __init__(self, save_id: _Optional[str] = ...) -> None: ...

class AbortSaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitTierRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "tier", "timeout_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    tier: Tier
    timeout_seconds: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WaitTierResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("found", "step", "unreachable")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    step: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, found: _Optional[bool] = ..., step: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class AvailabilityRequest(_message.Message):
    __slots__ = ("job", "rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class StepAvailability(_message.Message):
    __slots__ = ("step", "world_size", "tiers", "nodes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class AvailabilityResponse(_message.Message):
    __slots__ = ("steps", "unreachable")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepAvailability]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepAvailability, _Mapping]]] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class RankLocation(_message.Message):
    __slots__ = ("rank", "tiers", "nodes", "bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    def __init__(self, rank: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., nodes: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("step", "world_size", "complete", "ranks", "tiers", "created_unix")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    complete: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankLocation]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    created_unix: float
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., complete: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankLocation, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., created_unix: _Optional[float] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job", "rank", "has_step", "step", "transfer", "local_corrupt", "corrupt_generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    has_step: bool
    step: int
    transfer: Transfer
    local_corrupt: bool
    corrupt_generation: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ..., transfer: _Optional[_Union[Transfer, str]] = ..., local_corrupt: _Optional[bool] = ..., corrupt_generation: _Optional[str] = ...) -> None: ...

class RestoreProgressRequest(_message.Message):
    __slots__ = ("job", "rank", "has_step", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    has_step: bool
    step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class RestoreProgressResponse(_message.Message):
    __slots__ = ("fetching", "step", "tier", "bytes_done", "bytes_total", "source")
    FETCHING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    fetching: bool
    step: int
    tier: Tier
    bytes_done: int
    bytes_total: int
    source: str
    def __init__(self, fetching: _Optional[bool] = ..., step: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class RestoredShard(_message.Message):
    __slots__ = ("name", "size", "checksum", "dtype", "shape", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    checksum: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    path: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., path: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("step", "tier", "world_size", "metadata_json", "shards", "fs_token", "source_node", "local_dir", "generation")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DIR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    step: int
    tier: Tier
    world_size: int
    metadata_json: str
    shards: _containers.RepeatedCompositeFieldContainer[RestoredShard]
    fs_token: str
    source_node: str
    local_dir: str
    generation: str
    def __init__(self, step: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., world_size: _Optional[int] = ..., metadata_json: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[RestoredShard, _Mapping]]] = ..., fs_token: _Optional[str] = ..., source_node: _Optional[str] = ..., local_dir: _Optional[str] = ..., generation: _Optional[str] = ...) -> None: ...

class ReadShardRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "shard")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    shard: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., shard: _Optional[str] = ...) -> None: ...

class ReadShardResponse(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    generation: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., generation: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "steps", "has_latest", "latest", "bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    HAS_LATEST_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    steps: int
    has_latest: bool
    latest: int
    bytes: int
    def __init__(self, job: _Optional[str] = ..., steps: _Optional[int] = ..., has_latest: _Optional[bool] = ..., latest: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("node_id", "address", "up", "last_seen_unix", "last_error", "clock_skew_seconds", "clock_skew_known")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SKEW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SKEW_KNOWN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    up: bool
    last_seen_unix: float
    last_error: str
    clock_skew_seconds: float
    clock_skew_known: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., up: _Optional[bool] = ..., last_seen_unix: _Optional[float] = ..., last_error: _Optional[str] = ..., clock_skew_seconds: _Optional[float] = ..., clock_skew_known: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "version", "local_dir", "capacity_bytes", "used_bytes", "staging_bytes", "recycle_bytes", "jobs", "peers", "persistent_url", "drain_backlog_bytes", "drain_backlog_steps", "drain_oldest_age_seconds", "replicas", "uptime_seconds", "persistent_error", "now_unix", "fs_token", "reserve_bytes", "reserve_target_bytes", "reserve_ready_bytes", "reserve_taken_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DIR_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECYCLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_URL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAIN_BACKLOG_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_OLDEST_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_ERROR_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_FIELD_NUMBER: _ClassVar[int]
    FS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_READY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TAKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    local_dir: str
    capacity_bytes: int
    used_bytes: int
    staging_bytes: int
    recycle_bytes: int
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    persistent_url: str
    drain_backlog_bytes: int
    drain_backlog_steps: int
    drain_oldest_age_seconds: float
    replicas: int
    uptime_seconds: float
    persistent_error: str
    now_unix: float
    fs_token: str
    reserve_bytes: int
    reserve_target_bytes: int
    reserve_ready_bytes: int
    reserve_taken_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., local_dir: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., recycle_bytes: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., persistent_url: _Optional[str] = ..., drain_backlog_bytes: _Optional[int] = ..., drain_backlog_steps: _Optional[int] = ..., drain_oldest_age_seconds: _Optional[float] = ..., replicas: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., persistent_error: _Optional[str] = ..., now_unix: _Optional[float] = ..., fs_token: _Optional[str] = ..., reserve_bytes: _Optional[int] = ..., reserve_target_bytes: _Optional[int] = ..., reserve_ready_bytes: _Optional[int] = ..., reserve_taken_bytes: _Optional[int] = ...) -> None: ...

class JobPolicy(_message.Message):
    __slots__ = ("keep_local", "keep_persistent", "persist_every", "redundancy")
    KEEP_LOCAL_FIELD_NUMBER: _ClassVar[int]
    KEEP_PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    PERSIST_EVERY_FIELD_NUMBER: _ClassVar[int]
    REDUNDANCY_FIELD_NUMBER: _ClassVar[int]
    keep_local: int
    keep_persistent: int
    persist_every: int
    redundancy: str
    def __init__(self, keep_local: _Optional[int] = ..., keep_persistent: _Optional[int] = ..., persist_every: _Optional[int] = ..., redundancy: _Optional[str] = ...) -> None: ...

class SetJobPolicyRequest(_message.Message):
    __slots__ = ("job", "policy", "reset")
    JOB_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    job: str
    policy: JobPolicy
    reset: bool
    def __init__(self, job: _Optional[str] = ..., policy: _Optional[_Union[JobPolicy, _Mapping]] = ..., reset: _Optional[bool] = ...) -> None: ...

class GetJobPolicyRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class JobPolicyResponse(_message.Message):
    __slots__ = ("job", "policy", "effective")
    JOB_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_FIELD_NUMBER: _ClassVar[int]
    job: str
    policy: JobPolicy
    effective: JobPolicy
    def __init__(self, job: _Optional[str] = ..., policy: _Optional[_Union[JobPolicy, _Mapping]] = ..., effective: _Optional[_Union[JobPolicy, _Mapping]] = ...) -> None: ...

class TierSelection(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class DeleteStepRequest(_message.Message):
    __slots__ = ("job", "step", "tiers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tiers: TierSelection
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tiers: _Optional[_Union[TierSelection, _Mapping]] = ...) -> None: ...

class DeleteStepResponse(_message.Message):
    __slots__ = ("local_ranks", "peer_ranks", "persistent_ranks", "persistent_objects", "unreachable")
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    PEER_RANKS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    local_ranks: int
    peer_ranks: int
    persistent_ranks: int
    persistent_objects: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, local_ranks: _Optional[int] = ..., peer_ranks: _Optional[int] = ..., persistent_ranks: _Optional[int] = ..., persistent_objects: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class CopyCheck(_message.Message):
    __slots__ = ("step", "rank", "tier", "node", "state", "detail")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    tier: Tier
    node: str
    state: CopyState
    detail: str
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., node: _Optional[str] = ..., state: _Optional[_Union[CopyState, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("job", "has_step", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    has_step: bool
    step: int
    def __init__(self, job: _Optional[str] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("copies", "mismatches", "unreachable")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[CopyCheck]
    mismatches: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, copies: _Optional[_Iterable[_Union[CopyCheck, _Mapping]]] = ..., mismatches: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class PersistStepRequest(_message.Message):
    __slots__ = ("job", "step", "wait", "timeout_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    wait: bool
    timeout_seconds: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., wait: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class PersistStepResponse(_message.Message):
    __slots__ = ("queued", "persisted", "unreachable")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    queued: _containers.RepeatedScalarFieldContainer[int]
    persisted: _containers.RepeatedScalarFieldContainer[int]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queued: _Optional[_Iterable[int]] = ..., persisted: _Optional[_Iterable[int]] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...
