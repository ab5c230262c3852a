"""Daemon configuration: read once, at the edge, into a frozen and validated dataclass.

Sources, lowest precedence first: built-in defaults, the TOML file given by ``--config``, command
line flags. TOML keys are the flag names with ``_`` for ``-``. Nothing else in the daemon reads
``os.environ`` except the persistent backends, which follow the standard cloud SDK environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import itertools
import re
import tomllib
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tierckpt.common.names import MAX_METADATA_BYTES, MAX_SHARDS_PER_RANK, check_node
from tierckpt.errors import InvalidArgumentError

from .redact import redact_url

if TYPE_CHECKING:
    from .access import TenantSocket

__all__ = ["ConfigError", "DaemonConfig", "Peer", "is_loopback_host", "parse_args", "load_config", "parse_size"]


class ConfigError(InvalidArgumentError):
    """The configuration is invalid; the message names the offending key."""


@dataclass(frozen=True)
class Peer:
    node_id: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class DaemonConfig:
    """Every option of tierckptd. Field names are the TOML keys; flags are the same with ``-``."""

    node_id: str = "node0"
    """Identity of this node among its peers; a replacement node reuses the id of the node it replaces."""
    listen: str = ""
    """TCP listener HOST:PORT for remote clients and peers (port 0 picks a free port). Empty (the default): none; local
    tools use the Unix socket. Any TCP listener, loopback included, needs tls_cert/tls_key/tls_ca or insecure_listen."""
    insecure_listen: bool = False
    """Serve the TCP listener and the bulk channel without mTLS (loopback included): anyone who can reach them may
    read, write and delete checkpoints and act as a peer. Logged as a warning at start-up."""
    socket: str = "/run/tierckpt/tierckptd.sock"
    """Unix socket for clients on this node. Empty disables it."""
    socket_mode: int = 0o660
    """Permission bits of the Unix socket (TOML: an integer or an octal string such as "0660")."""
    socket_group: str = ""
    """Group owning the Unix socket (name or gid), so only the trainers' group can use it."""
    socket_tenant: str = ""
    """The identity callers on `socket` act as: a job belongs to the identity that first saved it ("" = the default
    tenant, which is all a single-tenant node needs). Name it after a client certificate to share jobs with it."""
    tenant_sockets: str = ""
    """More Unix sockets, one per tenant: "NAME=PATH:GROUP[:MODE],..." or a TOML table {NAME = {path = "...", group =
    "...", mode = "0660"}}. Callers on a tenant's socket save, restore and see only that tenant's jobs; no other
    identity can save, restore, replace or evict them. Each socket is created with its own group and mode."""
    local_dir: str = "/dev/shm/tierckpt"
    """Local tier directory: a RAM disk (tmpfs) or a directory on NVMe."""
    local_capacity: int = 0
    """Bytes the local tier may hold (0 = 90% of the filesystem's size at start-up)."""
    local_reserve: int = 0
    """Bytes of memory the local tier holds from start-up, pre-touched, for new staging files of saves and replicas
    (0 = none): size it like a RAM disk for a job, (keep_local + 1) x this node's checkpoint, so that back-to-back
    saves never wait for new pages. Counted as used in local_capacity (which must hold it); refilled from evicted
    files and, when idle, in the background."""
    fsync: str = "auto"
    """Flush data and manifests before a commit: "auto" (not on tmpfs), "always" or "never"."""
    keep_local: int = 2
    """Newest complete steps per job kept locally (>= 1)."""
    staging_timeout: float = 600.0
    """Seconds an uncommitted save may hold its staging files before they are reclaimed."""
    max_shard_bytes: int = 1 << 40
    """Largest single shard accepted."""
    max_open_saves: int = 1024
    """Saves open (begun, not yet committed or aborted) at once on this node; more get RESOURCE_EXHAUSTED."""
    max_shards_per_save: int = 4096
    """Shards one save (one rank of one step) may declare, 1..4096; more get INVALID_ARGUMENT naming shards. Every
    file is charged at least 4 KiB against local_capacity, so zero-byte shards still count."""
    max_metadata_bytes: int = 1 << 20
    """Metadata one rank's commit may carry, up to 1 MiB; more gets INVALID_ARGUMENT naming metadata. The manifest
    it is stored in is charged against local_capacity (its size, at least 4 KiB)."""
    max_open_saves_per_client: int = 0
    """Saves one TCP client (one certificate identity) may hold open at once (0 = only max_open_saves). Unix-socket
    callers are bound by max_open_saves alone: grpcio exposes no peer credentials of a socket caller."""
    client_jobs: str = ""
    """Jobs each TCP client may use, by certificate name (CN or DNS SAN; * and ? match): "NAME=GLOB,..." or a TOML
    table {NAME = ["GLOB", ...]}, e.g. "trainer-a=llama-*,ops=*". Other names get PERMISSION_DENIED. Empty: every
    certificate the CA signed may use every job. Needs mTLS. Unix-socket callers are not restricted."""
    max_message_bytes: int = 16 << 20
    """Largest gRPC message accepted or sent (bulk data moves in chunks below this)."""
    max_concurrent_streams: int = 256
    """Concurrent RPCs served; more wait."""
    peers: tuple[Peer, ...] = ()
    """Peer daemons as ID=HOST:PORT; this node's own id may appear and is ignored."""
    peers_dns: str = ""
    """NAME:PORT of a headless Service whose A records are the peers (Kubernetes)."""
    replicas: int = 1
    """Peer copies made of every committed rank (0 disables replication)."""
    redundancy: str = "replicas"
    """Peer redundancy: "replicas" (`replicas` full copies of every rank) or "parity:K+M" (erasure coding across
    placement groups of K+M consecutive ring nodes, K + M <= 32: 1 + M/K of the memory per node, survives the loss of
    M nodes of a group; XOR for M = 1, Reed-Solomon for M >= 2; `replicas` is then 0)."""
    persistent: str = ""
    """Object store URL: file:///dir, s3://bucket/prefix or gs://bucket/prefix (empty: no persistent tier)."""
    persist_every: int = 0
    """Drain to the persistent tier every step whose number is a multiple of N, and every save with persist=True (0 =
    only those)."""
    keep_persistent: int = 0
    """Newest steps per job kept in the persistent tier (0 = keep all)."""
    persistent_layout: str = "content"
    """Object layout of drained steps: "content" (content-addressed chunks shared across steps:
    unchanged data is not uploaded again, and is compressed by ``codec``) or "per-shard" (one
    object per shard and save, the layout of earlier versions). Both are always read."""
    codec: str = "auto"
    """How the persistent tier's content layout compresses chunks: "auto" (by dtype: ZipNN for
    float16/bfloat16/float32, its byte groups Huffman-coded; zstd for the rest), "none", "zstd"
    (every shard) or "bg-zstd" (the older byte planes + zstd, by element size where the dtype has
    one); a chunk that does not shrink is stored raw. Chunks are read whatever the setting."""
    manifest_key_file: str = ""
    """File holding the cluster's manifest key (>= 32 bytes; not readable by others), the same on every node and never
    in the bucket: every manifest written (local, replica, persistent) carries an HMAC-SHA256 of all its fields, and
    a manifest read without a matching one (forged, edited) is data loss. Empty: manifests are unsigned (warned at
    start-up). Make one with: head -c 32 /dev/urandom | base64 > manifest.key."""
    accept_unsigned_manifests: bool = False
    """With manifest_key_file: still read manifests that carry no MAC (steps written before signing was turned on;
    tierckpt verify lists them). A forged manifest without a MAC is read too while this is on."""
    s3_endpoint: str = ""
    """S3 endpoint URL for MinIO, Ceph RGW or another S3-compatible store, e.g.
    "https://minio.example:9000" (empty: AWS_ENDPOINT_URL or AWS's own)."""
    s3_region: str = ""
    """S3 region, e.g. "eu-west-1" (empty: AWS_REGION / AWS_DEFAULT_REGION or the AWS config
    file)."""
    s3_addressing_style: str = "auto"
    """"path" (https://endpoint/bucket/key: MinIO, Ceph and most S3-compatible stores),
    "virtual" (https://bucket.endpoint/key) or "auto" (the SDK's choice)."""
    s3_sse: str = ""
    """Server-side encryption of every object written: "AES256" (SSE-S3), "aws:kms" (SSE-KMS,
    see s3_sse_kms_key_id) or empty (the bucket's default)."""
    s3_sse_kms_key_id: str = ""
    """KMS key id or ARN for s3_sse = "aws:kms" (empty: the account's aws/s3 key)."""
    s3_storage_class: str = ""
    """Storage class of every object written, e.g. "STANDARD", "INTELLIGENT_TIERING",
    "STANDARD_IA" (empty: the bucket's default)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = disabled)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds to."""
    tls_cert: str = ""
    """PEM certificate of this node for peer traffic (mTLS); needs tls_key and tls_ca."""
    tls_key: str = ""
    """PEM private key matching tls_cert; refused if readable by group or others (chmod 600)."""
    tls_ca: str = ""
    """PEM CA bundle that signs every peer's certificate. The three files are re-read when they change (rotation
    without restart)."""
    tls_key_group_readable: bool = False
    """Accept a tls_key readable by its group (never by others): for Kubernetes Secret volumes, which the kubelet makes
    0440 for the pod's fsGroup. Refused when that group is socket_group."""
    tls_deny: str = ""
    """File of certificate names refused on the TCP listener and the bulk channel, one per line (CN, DNS SAN, node id
    or client name; # comments). Re-read when it changes: takes effect without a restart, on open connections too."""
    tls_bind_node_id: bool = True
    """Require a peer's certificate to name the node id it claims (CN or DNS SAN). False only where every node shares
    one certificate (see SECURITY.md)."""
    log_level: str = "INFO"
    """DEBUG, INFO, WARNING or ERROR."""
    log_format: str = "plain"
    """"plain" or "json"."""
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM waits for in-flight commits and replication before exiting."""
    knobs: str = ""
    """Tuning overrides NAME=VALUE,... of tierckptd.knobs (grace periods, intervals, stream counts); for tests and
    experts, not needed in production."""

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def tenant_socket_list(self) -> list[TenantSocket]:
        from .access import parse_tenant_sockets

        return parse_tenant_sockets(self.tenant_sockets)

    @property
    def client_jobs_rules(self) -> dict[str, tuple[str, ...]]:
        from .access import parse_client_jobs

        return parse_client_jobs(self.client_jobs)

    @property
    def parity(self) -> tuple[int, int] | None:
        """(K, M) of ``redundancy = "parity:K+M"``; None for replicas."""
        return parse_redundancy(self.redundancy)

    def other_peers(self) -> tuple[Peer, ...]:
        return tuple(p for p in self.peers if p.node_id != self.node_id)


_PARITY_RE = re.compile(r"^parity:(\d{1,3})\+(\d{1,2})$")


def parse_redundancy(text: str) -> tuple[int, int] | None:
    """``"replicas"`` -> None; ``"parity:K+M"`` -> (K, M): XOR parity for M = 1, Reed-Solomon
    (ISA-L, else numpy) for M >= 2.

    Raises:
        ConfigError: anything else, K < 1, M < 1, or K + M > 32.
    """
    if text == "replicas":
        return None
    m = _PARITY_RE.match(text)
    if not m:
        raise ConfigError(f"redundancy: {text!r} must be replicas or parity:K+M (e.g. parity:4+1, parity:4+2)")
    k, mm = int(m.group(1)), int(m.group(2))
    if k < 1 or mm < 1:
        raise ConfigError(f"redundancy: {text!r} needs K >= 1 data nodes and M >= 1 parity nodes")
    if k + mm > _MAX_GROUP:
        raise ConfigError(f"redundancy: {text!r}: a parity group has at most {_MAX_GROUP} nodes (K + M <= "
                          f"{_MAX_GROUP})")
    return k, mm


_MAX_GROUP = 32
_REPLICAS_RE = re.compile(r"^replicas:(\d{1,2})$")


def parse_job_redundancy(text: str) -> tuple[int, tuple[int, int] | None]:
    """A job policy's ``redundancy``: ``"replicas:R"`` -> (R, None); ``"parity:K+M"`` -> (0, (K, M))
    with the checks of :func:`parse_redundancy`. Bounds that depend on the cluster (R peers, K + M
    nodes) are checked by the peer tier.

    Raises:
        ConfigError: anything else, or R > 31.
    """
    m = _REPLICAS_RE.match(text)
    if m:
        r = int(m.group(1))
        if r >= _MAX_GROUP:
            raise ConfigError(f"redundancy: {text!r}: R must be < {_MAX_GROUP}")
        return r, None
    if text == "replicas":
        raise ConfigError("redundancy: 'replicas' needs a count in a job policy: replicas:R (e.g. replicas:1)")
    shape = parse_redundancy(text)
    assert shape is not None
    return 0, shape


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4, "PI": 1024**5}


def parse_size(value: Any, key: str) -> int:
    """Parse ``123``, ``"64MiB"``, ``"10G"`` into bytes, naming ``key`` on error."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ConfigError(f"{key}: {value!r} is not a size (examples: 1073741824, 512MiB, 2GiB)")
        unit = (m.group(2) or "").upper().rstrip("B")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise ConfigError(f"{key}: must not be negative")
    return n


def parse_peers(value: Any, key: str = "peers") -> tuple[Peer, ...]:
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(s).strip() for s in value]
    else:
        raise ConfigError(f"{key}: expected 'ID=HOST:PORT,...' or a list of them")
    peers: list[Peer] = []
    seen: set[str] = set()
    for item in items:
        node, sep, addr = item.partition("=")
        host, colon, port = addr.rpartition(":")
        if not sep or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{key}: {item!r} is not ID=HOST:PORT")
        try:
            check_node(node, key)
        except InvalidArgumentError as e:
            raise ConfigError(str(e)) from None
        if node in seen:
            raise ConfigError(f"{key}: node id {node!r} appears twice")
        seen.add(node)
        peers.append(Peer(node, host.strip("[]"), int(port)))
    return tuple(peers)


def _parse_mode(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        try:
            mode = int(str(value), 8)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not an octal mode such as 0660") from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"{key}: {value!r} is out of range 0..0777")
    return mode


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


def _coerce(key: str, value: Any) -> Any:
    if key in ("local_capacity", "local_reserve", "max_shard_bytes", "max_message_bytes", "max_metadata_bytes"):
        return parse_size(value, key)
    if key == "peers":
        return parse_peers(value, key)
    if key == "socket_mode":
        return _parse_mode(value, key)
    if key == "tenant_sockets":
        from .access import format_tenant_sockets, parse_tenant_sockets

        try:
            return format_tenant_sockets(parse_tenant_sockets(value, key))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if key == "socket_tenant":
        from tierckpt.common.names import check_owner
        from tierckpt.errors import InvalidArgumentError

        try:
            return check_owner(value, key)
        except InvalidArgumentError as e:
            raise ConfigError(str(e)) from None
    if key == "client_jobs":
        from .access import format_client_jobs, parse_client_jobs

        try:
            return format_client_jobs(parse_client_jobs(value, key))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if key == "knobs" and isinstance(value, Mapping):  # a TOML table
        return ",".join(f"{k}={v}" for k, v in value.items())
    default = _FIELDS[key].default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        try:
            return int(value) if not isinstance(value, bool) else _bad(key, value, "an integer")
        except (TypeError, ValueError):
            _bad(key, value, "an integer")
    if isinstance(default, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            _bad(key, value, "a number")
    if not isinstance(value, str):
        _bad(key, value, "a string")
    return value


def _bad(key: str, value: Any, what: str):
    raise ConfigError(f"{key}: expected {what}, got {value!r}")


_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP literal, possibly in brackets, or a name) can only be a loopback address.

    ``localhost`` counts; any other name does not (it may resolve anywhere), nor do the wildcard
    addresses ``0.0.0.0`` and ``::`` or an empty host, which listen on every interface.
    """
    host = host.strip().strip("[]").split("%", 1)[0].lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _validate(cfg: DaemonConfig) -> DaemonConfig:
    try:
        check_node(cfg.node_id, "node_id")
    except InvalidArgumentError as e:
        raise ConfigError(str(e)) from None
    for key in ("keep_local",):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}: must be >= 1 (the newest complete step is always kept)")
    if cfg.local_capacity and cfg.local_reserve > cfg.local_capacity:
        raise ConfigError(f"local_reserve: {cfg.local_reserve} bytes exceed local_capacity ({cfg.local_capacity}), "
                          "which must hold it")
    if cfg.max_open_saves < 1:
        raise ConfigError("max_open_saves: must be >= 1")
    if not 1 <= cfg.max_shards_per_save <= MAX_SHARDS_PER_RANK:
        raise ConfigError(f"max_shards_per_save: must be 1..{MAX_SHARDS_PER_RANK}")
    if not 2 <= cfg.max_metadata_bytes <= MAX_METADATA_BYTES:
        raise ConfigError(f"max_metadata_bytes: must be 2..{MAX_METADATA_BYTES} (a JSON object)")
    if cfg.max_open_saves_per_client < 0:
        raise ConfigError("max_open_saves_per_client: must not be negative")
    if cfg.client_jobs and not cfg.tls_enabled:
        raise ConfigError("client_jobs: needs tls_cert/tls_key/tls_ca (clients are named by their certificates)")
    for key in ("replicas", "persist_every", "keep_persistent", "metrics_port", "max_concurrent_streams"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}: must not be negative")
    if cfg.metrics_port > 65535:
        raise ConfigError("metrics_port: must be <= 65535")
    if cfg.staging_timeout <= 0 or cfg.shutdown_timeout < 0:
        raise ConfigError("staging_timeout/shutdown_timeout: must be positive")
    if cfg.persistent_layout not in ("per-shard", "content"):
        raise ConfigError(f"persistent_layout: {cfg.persistent_layout!r} must be per-shard or content")
    from .persistent.compress import SETTINGS  # the one list (imported here: persistent imports config)

    if cfg.codec not in SETTINGS:
        raise ConfigError(f"codec: {cfg.codec!r} must be {', '.join(SETTINGS[:-1])} or {SETTINGS[-1]}")
    if cfg.fsync not in ("auto", "always", "never"):
        raise ConfigError(f"fsync: {cfg.fsync!r} must be auto, always or never")
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"log_level: {cfg.log_level!r} must be DEBUG, INFO, WARNING or ERROR")
    if cfg.log_format not in ("plain", "json"):
        raise ConfigError(f"log_format: {cfg.log_format!r} must be plain or json")
    if not cfg.local_dir:
        raise ConfigError("local_dir: must not be empty")
    if cfg.parity is not None and cfg.replicas:
        cfg = dataclasses.replace(cfg, replicas=0)  # parity replaces the full copies
    _validate_network(cfg)
    _validate_persistent(cfg)
    _validate_s3(cfg)
    if cfg.knobs:
        from .knobs import Knobs, parse_knobs

        try:
            Knobs().apply(parse_knobs(cfg.knobs))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.peers_dns:
        name, colon, port = cfg.peers_dns.rpartition(":")
        if not colon or not name or not port.isdigit():
            raise ConfigError(f"peers_dns: {cfg.peers_dns!r} is not NAME:PORT")
    return cfg


def _validate_network(cfg: DaemonConfig) -> None:
    """Listeners and TLS: default deny on the network (a non-loopback listener needs mTLS)."""
    if not cfg.listen and not cfg.socket:
        raise ConfigError("listen/socket: at least one listener is required")
    if cfg.listen:
        _host, colon, port = cfg.listen.rpartition(":")
        if not colon or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"listen: {cfg.listen!r} is not HOST:PORT")
    tls = [cfg.tls_cert, cfg.tls_key, cfg.tls_ca]
    if any(tls) and not all(tls):
        raise ConfigError("tls_cert/tls_key/tls_ca: give all three or none")
    if cfg.tls_deny and not cfg.tls_enabled:
        raise ConfigError("tls_deny: needs tls_cert/tls_key/tls_ca (it names certificates)")
    if cfg.listen and not cfg.tls_enabled and not cfg.insecure_listen:
        where = "a loopback" if is_loopback_host(cfg.listen.rpartition(":")[0]) else "a non-loopback"
        raise ConfigError(f"listen: {cfg.listen!r} refuses to serve TCP without mTLS ({where} address included: any "
                          "local user could reach it); set tls_cert/tls_key/tls_ca, or insecure_listen to accept "
                          "the risk; local tools use the Unix socket")


def _validate_persistent(cfg: DaemonConfig) -> None:
    """The persistent URL: a known scheme, and no credentials in it (they would reach logs)."""
    if not cfg.persistent:
        return
    shown = redact_url(cfg.persistent)  # never echo credentials (DESIGN: no secret in a log or an error)
    if not re.match(r"^(file|s3|gs)://", cfg.persistent):
        raise ConfigError(f"persistent: {shown!r} must start with file://, s3:// or gs://")
    try:
        parts = urllib.parse.urlsplit(cfg.persistent)
        secret = bool(parts.username or parts.password or parts.query or parts.fragment)
    except ValueError:
        raise ConfigError(f"persistent: {shown!r} is not a URL") from None
    if secret:
        raise ConfigError(f"persistent: {shown!r} must not carry credentials, a query or a fragment; "
                          "credentials come from the SDK's environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS)")


_S3_SSE = ("", "AES256", "aws:kms")
_STORAGE_CLASS_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")


def _validate_s3(cfg: DaemonConfig) -> None:
    if cfg.s3_endpoint:
        try:
            parts = urllib.parse.urlsplit(cfg.s3_endpoint)
            secret = bool(parts.username or parts.password or parts.query or parts.fragment)
        except ValueError:
            parts, secret = None, False
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"s3_endpoint: {redact_url(cfg.s3_endpoint)!r} is not an http:// or https:// URL")
        if secret:
            raise ConfigError(f"s3_endpoint: {redact_url(cfg.s3_endpoint)!r} must not carry credentials, "
                              "a query or a fragment")
    if cfg.s3_region and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", cfg.s3_region):
        raise ConfigError(f"s3_region: {cfg.s3_region!r} is not a region name such as eu-west-1")
    if cfg.s3_addressing_style not in ("auto", "path", "virtual"):
        raise ConfigError(f"s3_addressing_style: {cfg.s3_addressing_style!r} must be auto, path or virtual")
    if cfg.s3_sse not in _S3_SSE:
        raise ConfigError(f"s3_sse: {cfg.s3_sse!r} must be AES256, aws:kms or empty")
    if cfg.s3_sse_kms_key_id and cfg.s3_sse != "aws:kms":
        raise ConfigError("s3_sse_kms_key_id: needs s3_sse = \"aws:kms\"")
    if cfg.s3_storage_class and not _STORAGE_CLASS_RE.fullmatch(cfg.s3_storage_class):
        raise ConfigError(f"s3_storage_class: {cfg.s3_storage_class!r} is not a storage class "
                          "such as STANDARD_IA")


def load_config(file_values: Mapping[str, Any] | None = None,
                overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Build a validated config from TOML values and flag overrides (both keyed by field name)."""
    values: dict[str, Any] = {}
    for source in (file_values or {}, overrides or {}):
        for key, value in source.items():
            if key not in _FIELDS:
                raise ConfigError(f"{key}: unknown configuration key")
            if value is None:
                continue
            values[key] = _coerce(key, value)
    return _validate(DaemonConfig(**values))


def field_docs() -> dict[str, str]:
    """The documentation string under each DaemonConfig field (used for --help and the README)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(DaemonConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="tierckptd", description="tierckpt per-node checkpoint daemon. "
                                "Flags override the --config file; TOML keys are the flag names with _ for -.")
    p.add_argument("--version", action="version", version=f"tierckptd {__version__}",
                   help="print the version and exit")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file; keys are the flag names with _ for -")
    docs = field_docs()
    # What each value is, for --help: by the kind of value, not by the option's last word.
    metavars = {"node_id": "ID", "listen": "HOST:PORT", "socket": "PATH", "socket_mode": "MODE",
                "socket_group": "GROUP", "socket_tenant": "NAME", "tenant_sockets": "NAME=PATH:GROUP[:MODE],...",
                "local_dir": "DIR", "local_capacity": "BYTES", "local_reserve": "BYTES", "fsync": "auto|always|never",
                "staging_timeout": "SECONDS", "max_shard_bytes": "BYTES", "max_open_saves": "N",
                "max_shards_per_save": "N", "max_metadata_bytes": "BYTES",
                "max_open_saves_per_client": "N", "client_jobs": "NAME=GLOB,...",
                "max_message_bytes": "BYTES",
                "peers": "ID=HOST:PORT,...", "peers_dns": "NAME:PORT", "persistent": "URL", "metrics_port": "PORT",
                "metrics_host": "HOST", "tls_cert": "FILE.pem", "tls_key": "FILE.pem", "tls_ca": "FILE.pem",
                "tls_deny": "FILE",
                "log_level": "LEVEL", "log_format": "plain|json", "shutdown_timeout": "SECONDS",
                "knobs": "NAME=VALUE,...", "s3_endpoint": "URL", "s3_region": "REGION",
                "s3_addressing_style": "auto|path|virtual", "s3_sse": "AES256|aws:kms", "s3_sse_kms_key_id": "KEY",
                "s3_storage_class": "CLASS"}
    for name, f in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if name == "peers":
            default = ",".join(f"{x.node_id}={x.address}" for x in cast(tuple, f.default)) or "none"
        elif name == "socket_mode":
            default = f"0{f.default:o}"  # permission bits read in octal, as chmod takes them
        else:
            default = repr(f.default)
        help_text = f"{docs.get(name, '')} (default: {default})".replace("%", "%%")
        if isinstance(f.default, bool):  # --insecure-listen / --no-insecure-listen
            p.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        metavar = metavars.get(name) or ("N" if f.type in (int, "int") else "VALUE")
        p.add_argument(flag, dest=name, default=None, metavar=metavar, help=help_text)
    return p


def parse_args(argv: Sequence[str] | None = None) -> DaemonConfig:
    """Parse flags (and the TOML file they name) into a validated config. Raises ConfigError."""
    args = build_parser().parse_args(argv)
    file_values: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, "rb") as fh:
                file_values = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"config: cannot read {args.config}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {args.config} is not valid TOML: {e}") from None
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    cfg = load_config(file_values, overrides)
    if cfg.tls_enabled:
        # Read and check the TLS files now, before anything touches the disk: a missing file, a
        # key that does not match, or a key readable by group or others stops start-up here.
        from . import tls

        tls.reloader(cfg)
        from . import revocation

        revocation.deny_list(cfg)
    return cfg


def options_markdown() -> str:
    """The README's configuration table (``python -c 'from tierckptd.config import *; print(options_markdown())'``)."""
    docs = field_docs()
    rows = []
    for f in dataclasses.fields(DaemonConfig):
        default = {"peers": "", "socket_mode": "0660"}.get(f.name, f.default)
        if isinstance(default, bool):
            default = str(default).lower()
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{f.name}` | `{default}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)
