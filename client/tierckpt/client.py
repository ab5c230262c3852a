"""The thin tierckpt client: save often, restore from the nearest tier.

Same-node transfers move no shard bytes through gRPC: ``BeginSave`` returns staging files in the
daemon's local directory and the client copies each buffer straight into them (``pwrite`` from
several threads; the GIL is released). ``save()`` returns once the bytes are staged; hashing and
the commit run in a background thread and resolve the returned :class:`SaveFuture`. Restore maps
the committed files read-only and verifies their checksums. A client that cannot see the daemon's
filesystem (checked with the daemon's ``.fs-token``) streams bytes over gRPC instead, with
identical results.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from . import _pack
from ._admin import DataManagementMixin, JobPolicy
from ._buffers import ShardBuffer, as_buffer, to_tensor
from ._catalog import TIER_ENUM as _TIER_ENUM
from ._catalog import TIER_NAMES as _TIER_NAMES
from ._catalog import CatalogMixin, CheckpointInfo, RankLocation, StepAvailability
from ._loans import Loans
from ._restore import materialize, read_only_arrays
from ._saveplan import SavePlanner, split_packed
from ._staging import Copier, Deferred, HostCopier, Stager
from ._transfer import StagingMaps, copy_into, hash_staged, run_batched, typed_os_error, write_requests
from ._visible import FsView, Reporter, call_restore, log
from .common.names import (
    MAX_METADATA_BYTES,
    MAX_SHARDS_PER_RANK,
    check_job,
    check_rank,
    check_step,
    check_stored_shard,
)
from .common.status import error_from_rpc
from .errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
)
from .v1 import tierckpt_pb2 as pb
from .v1 import tierckpt_pb2_grpc as pb_grpc

__all__ = ["Client", "SaveFuture", "SaveResult", "Checkpoint", "CheckpointInfo", "RankLocation", "StepAvailability",
           "DEFAULT_ADDRESS"]

DEFAULT_ADDRESS = "unix:///run/tierckpt/tierckptd.sock"


@dataclass(frozen=True)
class SaveResult:
    """A rank committed in the local tier."""

    job: str
    step: int
    rank: int
    nbytes: int
    blocking_seconds: float  # time save() held the caller
    commit_seconds: float  # from save() call to local commit
    shared_bytes: int = 0  # bytes of unchanged shards the daemon linked from the base step (not written)


@dataclass(frozen=True)
class Checkpoint:
    """One restored rank. ``shards`` are read-only numpy arrays (zero-copy maps on the same node).

    On the same node the arrays map the daemon's files, which it keeps out of its recycle pool
    (so saves write fresh pages) until the maps are gone: call :meth:`close` (or use the
    checkpoint as a context manager) once the state is loaded, or drop every reference to it and
    its arrays; either way the daemon is told in the background.
    """

    job: str
    step: int
    rank: int
    world_size: int
    tier: str  # "local", "peer" or "persistent": where the bytes were found
    source_node: str
    metadata: dict
    shards: dict[str, np.ndarray]
    dtypes: dict[str, str] = field(default_factory=dict, repr=False)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    _buffers: dict[str, Any] = field(default_factory=dict, repr=False)
    _finalizers: dict = field(default_factory=dict, repr=False)
    _loans: Any = field(default=None, repr=False)

    def close(self) -> None:
        """Unmap the shards and tell the daemon, so that later saves may reuse the files' pages.

        ``shards`` is emptied. An array or tensor taken from this checkpoint that is still alive
        keeps its map (its bytes never change); the daemon is told once it is collected.
        Idempotent.
        """
        bufs = dict(self._buffers)
        self.shards.clear()
        self._buffers.clear()
        for b in bufs.values():
            if isinstance(b, memoryview):  # a packed shard's view into the pack's map
                try:
                    b.release()
                except BufferError:  # exported by an array the caller holds
                    pass
        for name, b in bufs.items():
            if not isinstance(b, mmap.mmap):
                continue
            try:
                b.close()
            except BufferError:  # still exported by an array the caller holds: released when collected
                continue
            fin = self._finalizers.get(name)
            if fin is not None:
                fin()
        del bufs
        if self._loans is not None:
            self._loans.flush(timeout=5.0)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tensor(self, name: str):
        """The shard as a torch tensor of its saved dtype (shares the read-only memory)."""
        return to_tensor(self._buffers[name], self.dtypes[name], self.shapes[name])

    def tensors(self) -> dict:
        return {n: self.tensor(n) for n in self.shards}


def _check_save(job: str, step: int, rank: int, world_size: int, shards: Mapping[str, Any],
                unchanged: Iterable[str]) -> frozenset[str]:
    """Validate a save's arguments; returns its ``unchanged`` names (see :func:`_check_unchanged`)."""
    check_job(job)
    check_step(step)
    check_rank(rank, world_size)
    if not isinstance(shards, Mapping) or not shards:
        raise InvalidArgumentError("shards: a non-empty mapping of name -> buffer is required")
    if len(shards) > MAX_SHARDS_PER_RANK:
        raise InvalidArgumentError(f"shards: at most {MAX_SHARDS_PER_RANK} shards per rank")
    for n in shards:
        _pack.check_name(check_stored_shard(n, "shards"))
    return _check_unchanged(unchanged, shards)


def _check_unchanged(unchanged: Iterable[str], shards: Mapping[str, Any]) -> frozenset[str]:
    """The ``unchanged`` names of a save, each one of its shards.

    Raises:
        InvalidArgumentError: not an iterable of shard names, or a name not in ``shards``.
    """
    if isinstance(unchanged, (str, bytes)):
        raise InvalidArgumentError("unchanged: an iterable of shard names is required, not one string")
    try:
        names = frozenset(unchanged)
    except TypeError:
        raise InvalidArgumentError(f"unchanged: {type(unchanged).__name__} is not an iterable of shard names") from None
    unknown = [n for n in names if not isinstance(n, str) or n not in shards]
    if unknown:
        raise InvalidArgumentError(f"unchanged: {sorted(map(repr, unknown))[:8]} not among the shards of this save")
    return names


def _staged_copies(buffers: list[ShardBuffer], maps: dict[str, Any], staged: dict[str, pb.StagedShard],
                   layout: _pack.Layout | None) -> tuple[list[tuple[str, Any, int]], tuple | None]:
    """What the commit thread hashes: (name, map or path, size) per written shard, and the pack's."""
    paths_sizes = [(b.name, maps.get(b.name) or staged[b.name].path, b.nbytes) for b in buffers]
    packed = None
    if layout is not None:
        packed = (layout, maps.get(_pack.PACK) or staged[_pack.PACK].path, staged[_pack.INDEX].path)
    return paths_sizes, packed


def _unshared(begun: pb.BeginSaveResponse, buffers: list[ShardBuffer], later: list[tuple[str, Deferred]],
              fut: SaveFuture) -> tuple[list[ShardBuffer], list[tuple[str, Deferred, pb.StagedShard]]]:
    """The buffers and deferred shards to write (with their staging files): the daemon linked the
    shared ones from the base step."""
    staged = {s.name: s for s in begun.shards}
    shared = {n for n, s in staged.items() if s.shared}
    fut.shared_bytes = sum(b.nbytes for b in buffers if b.name in shared) + sum(d.nbytes for n, d in later
                                                                                if n in shared)
    return [b for b in buffers if b.name not in shared], [(n, d, staged[n]) for n, d in later if n not in shared]


def _split_deferred(shards: Mapping[str, Any]) -> tuple[list[ShardBuffer], list[tuple[str, Deferred]]]:
    """The shards copied in save() (as buffers) and the deferred ones (see :mod:`tierckpt._staging`)."""
    later = [(n, v) for n, v in shards.items() if isinstance(v, Deferred)]
    return [as_buffer(n, v) for n, v in shards.items() if not isinstance(v, Deferred)], later


class SaveFuture(cf.Future):
    """Resolves to a :class:`SaveResult` when the rank is committed in the local tier.

    ``wait("peer" | "persistent")`` additionally waits for a background tier.

    ``staged`` (a :class:`concurrent.futures.Future`) resolves once every byte of the save is in
    the local tier's staging files: from then on the caller may change the buffers it saved. It
    is already done when ``save()`` returns, except for :class:`~tierckpt._staging.Deferred`
    shards (the torch integrations' tensors), copied after ``save()`` returned. A failed copy
    fails ``staged`` and the future alike; the future never resolves before ``staged``.
    """

    def __init__(self, client: Client, job: str, step: int, rank: int) -> None:
        super().__init__()
        self._client = client
        self.job, self.step, self.rank = job, step, rank
        self.blocking_seconds = 0.0
        self.shared_bytes = 0
        self.staged: cf.Future = cf.Future()
        self._held: Callable[[str | None, BaseException | None], Any] | None = None  # save(hold=True)
        self._held_lock = threading.Lock()

    def commit(self, metadata: Mapping[str, Any] | None = None) -> SaveFuture:
        """Commit a save begun with ``save(..., hold=True)`` (once its copies have landed).

        Args:
            metadata: replaces the metadata given to ``save()`` (None: keep it).

        Returns:
            This future, resolved once the rank is committed.

        Raises:
            InvalidArgumentError: bad metadata (the save stays held).
            FailedPreconditionError: the save was not held, or was already committed or aborted.
        """
        meta = None if metadata is None else _encode_metadata(metadata)
        self._release("commit")(meta, None)
        return self

    def abort(self, error: BaseException) -> None:
        """Abort a held save: nothing is committed, the future (and ``staged``, if not reached)
        fails with ``error``. No-op once the save was committed or aborted."""
        with self._held_lock:
            held, self._held = self._held, None
        if held is not None:
            held(None, error)

    def _hold(self, release: Callable[[str | None, BaseException | None], Any], holding: set) -> None:
        with self._held_lock:
            self._held = release
        holding.add(self)

    def _release(self, what: str) -> Callable[[str | None, BaseException | None], Any]:
        with self._held_lock:
            held, self._held = self._held, None
        if held is None:
            from .errors import FailedPreconditionError

            raise FailedPreconditionError(f"{self.job} step {self.step} rank {self.rank}: cannot {what}: the save "
                                          "was not begun with hold=True, or was already committed or aborted")
        return held

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until ``staged`` (the caller may then change what it saved); raises its failure."""
        self.staged.result(timeout)

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail the save, and ``staged`` too if it was not reached (nobody waits for it forever)."""
        if not self.staged.done():
            self.staged.set_exception(exception)
        super().set_exception(exception)

    def wait(self, tier: str = "local", timeout: float | None = None) -> list[str]:
        """Block until the rank is in ``tier``; returns the nodes holding it there.

        Raises:
            TierError: the tier failed for this rank (names what failed).
            DeadlineExceededError: not reached within ``timeout``.
        """
        if tier not in _TIER_ENUM:
            raise InvalidArgumentError(f"tier: {tier!r} must be local, peer or persistent")
        t0 = time.monotonic()
        try:
            self.result(timeout)
        except cf.TimeoutError:
            from .errors import DeadlineExceededError

            raise DeadlineExceededError(
                f"{self.job} step {self.step} not committed locally within {timeout}s") from None
        if tier == "local":
            return [self._client._node_id or "local"]
        remaining = None if timeout is None else max(0.001, timeout - (time.monotonic() - t0))
        return self._client._wait_tier(self.job, self.step, self.rank, tier, remaining)


def _channel(address: str, opts: list, cert: str | None, key: str | None, ca: str | None,
             server_name: str | None) -> grpc.Channel:
    """An mTLS channel when a client certificate is given (argument or TIERCKPT_TLS_CERT/_KEY/_CA),
    else a plain one (the Unix socket, or a loopback daemon without TLS)."""
    cert = cert or os.environ.get("TIERCKPT_TLS_CERT") or None
    key = key or os.environ.get("TIERCKPT_TLS_KEY") or None
    ca = ca or os.environ.get("TIERCKPT_TLS_CA") or None
    server_name = server_name or os.environ.get("TIERCKPT_TLS_SERVER_NAME") or None
    if not (cert or key or ca) or address.startswith("unix:"):
        return grpc.insecure_channel(address, options=opts)
    if not (cert and key and ca):
        raise InvalidArgumentError("tls_cert/tls_key/tls_ca: give all three (or set TIERCKPT_TLS_CERT, "
                                   "TIERCKPT_TLS_KEY and TIERCKPT_TLS_CA)")
    files = {}
    for field_name, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        try:
            with open(path, "rb") as f:
                files[field_name] = f.read()
        except OSError as e:
            raise InvalidArgumentError(f"{field_name}: cannot read {path}: {e.strerror or e}") from None
    creds = grpc.ssl_channel_credentials(files["tls_ca"], files["tls_key"], files["tls_cert"])
    if server_name:
        opts = [*opts, ("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(address, creds, options=opts)


class Client(CatalogMixin, DataManagementMixin):
    """A connection to the tierckpt daemon on this node.

    Args:
        address: ``unix:///path`` or ``host:port``; default ``$TIERCKPT_ADDRESS``, else
            ``unix:///run/tierckpt/tierckptd.sock``.
        timeout: deadline in seconds for control RPCs.
        transfer: "auto" (shared filesystem when the daemon's local dir is visible, else
            streaming), "shared" or "stream".
        io_threads: threads copying bytes into staging files.
        verify: check shard checksums on restore (a mismatch raises DataLossError). True checks
            copies served from the local tier; a copy the daemon has just fetched from a peer or
            the object store was verified by the daemon as it arrived (that is its restore hop)
            and is not hashed twice. "always" checks those too; False checks nothing.
        tls_cert, tls_key, tls_ca: client certificate, its key and the cluster CA (PEM files) for a
            daemon reached over TCP with mTLS (default: TIERCKPT_TLS_CERT, TIERCKPT_TLS_KEY,
            TIERCKPT_TLS_CA); unused on the Unix socket. ``tls_server_name``: the name to expect
            in the daemon's certificate when it differs from the address's host.
        pack_below, pack_min_shards: a save with at least ``pack_min_shards`` shards smaller than
            ``pack_below`` bytes stores them as one packed shard plus an index (see
            ``tierckpt._pack``); restore unpacks them transparently. 0 disables packing.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 60.0, transfer: str = "auto",
                 io_threads: int | None = None, verify: bool | str = True, pack_below: int = 2 << 20,
                 pack_min_shards: int = 16, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_ca: str | None = None, tls_server_name: str | None = None) -> None:
        if transfer not in ("auto", "shared", "stream"):
            raise InvalidArgumentError(f"transfer: {transfer!r} must be auto, shared or stream")
        if verify not in (True, False, "always"):
            raise InvalidArgumentError(f"verify: {verify!r} must be True, False or 'always'")
        for field_name, v in (("pack_below", pack_below), ("pack_min_shards", pack_min_shards)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{field_name}: {v!r} must be a non-negative integer (0 disables packing)")
        self.pack_below, self.pack_min_shards = pack_below, pack_min_shards
        self.address = address or os.environ.get("TIERCKPT_ADDRESS") or DEFAULT_ADDRESS
        self.timeout = timeout
        self.transfer = transfer
        self.verify = verify
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self._channel = _channel(self.address, opts, tls_cert, tls_key, tls_ca, tls_server_name)
        self._stub = pb_grpc.TierckptStub(self._channel)
        self._io = cf.ThreadPoolExecutor(io_threads or min(4, os.cpu_count() or 2), thread_name_prefix="tierckpt-io")
        self._committer = cf.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-commit")
        self._fs = FsView()
        self._planner = SavePlanner()
        self._maps = StagingMaps()
        self._loans = Loans(functools.partial(_end_loan, self))
        self._stager = Stager(self._maps, self._io)
        self._holding: set[SaveFuture] = set()  # saves begun with hold=True, not yet committed or aborted
        self._node_id: str | None = None
        self._fs_hidden = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for pending commits, then close the channel."""
        if self._closed:
            return
        self._closed = True
        _abort_held(self._holding)
        self._stager.shutdown()
        self._committer.shutdown(wait=True)
        self._loans.stop(timeout=5.0)
        self._io.shutdown(wait=True)
        self._maps.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: Callable, request, what: str, timeout: float | None = -1.0):
        try:
            return method(request, timeout=self.timeout if timeout == -1.0 else timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"{what} at {self.address}") from None

    # ------------------------------------------------------------------ saving

    def save(self, job: str, step: int, rank: int, world_size: int, shards: Mapping[str, Any], *,
             metadata: Mapping[str, Any] | None = None, persist: bool = False,
             policy: JobPolicy | None = None, unchanged: Iterable[str] = (),
             copier: Copier | None = None, hold: bool = False) -> SaveFuture:
        """Stage one rank's shards and commit them in the background.

        ``policy`` (a :class:`JobPolicy`) sets the job's ``keep_local`` / ``keep_persistent`` /
        ``persist_every`` on this node with the commit (fields left ``None`` keep their value).

        ``unchanged``: shards (also in ``shards``) whose bytes equal those of the step this
        client last committed for ``(job, rank)``; the daemon links that step's file where it
        still holds it (same name, size, dtype, shape), else the shard is written (README,
        "Unchanged shards"). A wrong hint stores the old bytes.

        Returns once the bytes are copied out of the caller's buffers: the caller may modify them
        immediately. The future resolves when the rank is committed in the local tier.
        Shards given as :class:`~tierckpt._staging.Deferred` are the exception: ``copier``
        (default: host arrays, ``np.copyto``) copies them into the staging files after this call
        returned; they must not change until the future's ``staged``.

        ``hold=True``: nothing commits until :meth:`SaveFuture.commit` (with the final metadata)
        or :meth:`SaveFuture.abort` (``tierckpt.dcp.Stager`` stages in ``stage()`` what DCP's
        ``write_data`` commits); :meth:`close` aborts saves still held.

        Raises:
            InvalidArgumentError: a bad name, rank, buffer or metadata, or an ``unchanged`` name that
                is not in ``shards`` (nothing is stored).
            CapacityError: the local tier is full.
            UnavailableError: the daemon cannot be reached.
        """
        t0 = time.perf_counter()
        hint = _check_save(job, step, rank, world_size, shards, unchanged)
        buffers, later = _split_deferred(shards)
        copier = copier or HostCopier()
        mark = copier.mark([d.source for _, d in later]) if later else None  # the bytes of this point
        meta = _encode_metadata(metadata)
        pol = policy.to_pb() if policy is not None else None
        stream = self.transfer == "stream" or self._fs_hidden
        specs, layout = self._planner.plan(buffers, self.pack_below, self.pack_min_shards)
        buffers, pack = split_packed(buffers, layout)  # the small shards go in one pack shard (see _pack)
        specs = [*specs, *(pb.ShardSpec(name=n, size=d.nbytes, dtype=d.dtype, shape=list(d.shape)) for n, d in later)]
        req = pb.BeginSaveRequest(job=job, step=step, rank=rank, world_size=world_size, shards=specs,
                                  transfer=pb.TRANSFER_STREAM if stream else pb.TRANSFER_SHARED_FS)
        self._planner.hint(req, hint)
        begun, stream = self._begin(req, stream)
        fut = SaveFuture(self, job, step, rank)
        buffers, deferred = _unshared(begun, buffers, later, fut)
        digests: dict[str, str] | None = None  # streamed saves: filled as the stream is sent
        try:
            if stream:  # no staging files to copy deferred shards into: host copies now
                buffers += [ShardBuffer(n, copier.host_copy(d.source), d.dtype, d.shape) for n, d, _ in deferred]
                deferred, digests = [], {}
                self._call(self._stub.WriteShard, write_requests(begun.save_id, buffers, digests, pack), "WriteShard",
                           timeout=None)
            else:
                staged = {s.name: s for s in begun.shards}
                maps = copy_into(self._io, self._maps, buffers, staged, pack)
        except BaseException:
            self._abort(begun.save_id)
            raise
        stage = self._stager.submit(fut.staged, copier, mark, deferred) if deferred else None
        if stage is None:
            fut.staged.set_result(None)
        sizes = [(n, d.nbytes) for n, d, _ in deferred]
        del later, deferred  # the sources stay referenced by the staging thread only until copied
        fut.blocking_seconds = time.perf_counter() - t0
        paths_sizes: list[tuple[str, Any, int]] = []
        packed: tuple | None = None
        if not stream:  # hashed from the staged copies (kept maps, else the files)
            paths_sizes, packed = _staged_copies(buffers, maps, staged, layout)
        args = (fut, begun.save_id, digests, paths_sizes, meta, persist, t0, pol, packed, (stage, sizes))
        if hold:
            fut._hold(functools.partial(_release_held, self, args), self._holding)
        else:
            self._committer.submit(self._finish, *args)
        return fut

    def _begin(self, req: pb.BeginSaveRequest, stream: bool) -> tuple[pb.BeginSaveResponse, bool]:
        """BeginSave; a client that finds it cannot see the daemon's files streams from then on.
        Returns the answer and whether the bytes are streamed."""
        begun = self._call(self._stub.BeginSave, req, "BeginSave")
        if stream or self._sees(begun.local_dir, begun.fs_token):
            return begun, stream
        self._abort(begun.save_id)
        if self.transfer == "shared":
            raise InvalidArgumentError("transfer: 'shared' but the daemon's local_dir is not visible here")
        self._fs_hidden = True  # the daemon's files are not visible from here: stream from now on
        req.transfer = pb.TRANSFER_STREAM
        return self._call(self._stub.BeginSave, req, "BeginSave"), True

    def _sees(self, local_dir: str, token: str) -> bool:
        """Whether the daemon's files are visible here (else a warning, once per client, says why)."""
        return self.transfer != "stream" and self._fs.sees(local_dir, token, warn=self.transfer == "auto")

    def _finish(self, fut: SaveFuture, save_id: str, digests: dict[str, str] | None,
                paths_sizes: list[tuple[str, Any, int]], meta: str, persist: bool, t0: float,
                policy: pb.JobPolicy | None = None, packed: tuple[_pack.Layout, Any, str] | None = None,
                deferred: tuple[cf.Future | None, list[tuple[str, int]]] = (None, []),
                fail: BaseException | None = None) -> None:
        digests_streamed, dests = digests is not None, None
        try:
            if deferred[0] is not None:  # no commit before staged: a failed copy aborts the save
                dests = deferred[0].result()
                paths_sizes = [*paths_sizes, *((n, dests.maps[n] if size else "", size) for n, size in deferred[1])]
            if fail is not None:  # a held save aborted by its owner (once its copies are done with the maps)
                raise fail
            if not fut.set_running_or_notify_cancel():
                self._abort(save_id)
                return
            if digests is None:  # staged through the shared dir: hash the staged copies
                digests = {}
                if packed is not None:
                    digests.update(_pack.finish_staged(self._io, self._maps, *packed))
                hashes = run_batched(self._io, lambda p: hash_staged(p[1], p[2]), paths_sizes, lambda p: p[2])
                digests.update((name, h) for (name, _, _), h in zip(paths_sizes, hashes))
            req = pb.CommitSaveRequest(save_id=save_id, metadata_json=meta, persist=persist, policy=policy,
                                       digests=[pb.ShardDigest(name=n, checksum=d) for n, d in digests.items()])
            resp = self._call(self._stub.CommitSave, req, "CommitSave")
            self._planner.committed(fut.job, fut.rank, fut.step, save_id)
            seconds = time.perf_counter() - t0
            log.info("saved %s step %d rank %d into the local tier%s: %d bytes in %.3fs (caller blocked %.3fs%s%s)",
                     fut.job, fut.step, fut.rank, " (to persist)" if persist else "", resp.bytes, seconds,
                     fut.blocking_seconds, f", {fut.shared_bytes} bytes linked unchanged" if fut.shared_bytes else "",
                     ", streamed" if digests_streamed else "")
            fut.set_result(SaveResult(fut.job, fut.step, fut.rank, resp.bytes, fut.blocking_seconds, seconds,
                                      fut.shared_bytes))
        except BaseException as e:  # thread boundary: the future carries the error, typed
            self._abort(save_id)
            if isinstance(e, OSError):
                e = typed_os_error(e, "commit")
            elif not isinstance(e, TierckptError):
                e = InternalError(f"commit failed: {e!r}")
            if not fut.cancelled():
                fut.set_exception(e)
        finally:
            if dests is not None:
                dests.close()
            self._maps.trim()  # in this background thread, not in a later save's blocking path

    def _abort(self, save_id: str) -> None:
        try:
            self._stub.AbortSave(pb.AbortSaveRequest(save_id=save_id), timeout=self.timeout)
        except grpc.RpcError:
            pass  # best effort: the daemon reclaims expired staging anyway

    def _wait_tier(self, job: str, step: int, rank: int, tier: str, timeout: float | None) -> list[str]:
        req = pb.WaitTierRequest(job=job, step=step, rank=rank, tier=_TIER_ENUM[tier], timeout_seconds=timeout or 0)
        return list(self._call(self._stub.WaitTier, req, "WaitTier",
                               timeout=None if timeout is None else timeout + 5).nodes)

    # ------------------------------------------------------------------ restore

    def restore(self, job: str, rank: int, step: int | None = None, *,
                progress: Callable[..., None] | None = None) -> Checkpoint:
        """Restore one rank from the nearest tier holding it (local, peer, persistent).

        Args:
            step: default: ``latest(job)``.
            progress: called with (bytes_done, bytes_total) while this process maps and verifies
                (or receives) the rank; a callable taking a third argument is called with
                (bytes_done, bytes_total, tier): first while the daemon fetches the rank from
                the "peer" or "persistent" tier into its local tier, then with "local" for this
                process's part (see :mod:`tierckpt._visible`). From any thread.

        Raises:
            NotFoundError: no tier holds the step (or the job has no complete step).
            DataLossError: every copy failed its checksum.
        """
        check_job(job)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank: {rank!r} must be a non-negative integer")
        if step is not None:
            check_step(step)
        req = pb.RestoreRequest(job=job, rank=rank, has_step=step is not None, step=step or 0,
                                transfer=pb.TRANSFER_STREAM if self.transfer == "stream" else pb.TRANSFER_SHARED_FS)
        t0 = time.perf_counter()
        report = Reporter(progress)
        resp = call_restore(self._stub, req, self.address, report)
        fetched = time.perf_counter() - t0
        try:
            try:
                ck = self._materialize(resp, job, rank, report)
            except NotFoundError:  # a file went away after the daemon answered: ask once more
                resp = call_restore(self._stub, req, self.address, report)
                ck = self._materialize(resp, job, rank, report)
        except DataLossError:
            # Mapped or streamed, the bytes came from the daemon's local tier: it re-verifies
            # that copy, drops it if it is corrupt and tries the next tier.
            req.local_corrupt = True
            req.corrupt_generation = resp.generation
            req.has_step, req.step = True, resp.step
            resp = call_restore(self._stub, req, self.address, report)
            ck = self._materialize(resp, job, rank, report)
        log.info("restored %s step %d rank %d from the %s tier: %d bytes in %.3fs (daemon %.3fs, then %s)", job,
                 ck.step, rank, ck.tier, sum(s.size for s in resp.shards), time.perf_counter() - t0, fetched,
                 "streamed over gRPC" if self._streamed(resp) else "mapped")
        return ck

    def _streamed(self, resp: pb.RestoreResponse) -> bool:
        return not self._sees(resp.local_dir, resp.fs_token)

    def _materialize(self, resp: pb.RestoreResponse, job: str, rank: int, report: Reporter) -> Checkpoint:
        shared = self._sees(resp.local_dir, resp.fs_token)
        rows, pack, finalizers = materialize(self._io, self._loans, self._stub, self.address, resp, job, rank,
                                             report.copy(), shared=shared, transfer=self.transfer,
                                             verify=self.verify)
        arrays, buffers, dtypes, shapes = read_only_arrays(rows)
        if pack is not None:
            buffers[_pack.PACK] = pack  # closed by Checkpoint.close() after the views
        return Checkpoint(job=job, step=resp.step, rank=rank, world_size=resp.world_size,
                          tier=_TIER_NAMES.get(resp.tier, "local"), source_node=resp.source_node,
                          metadata=json.loads(resp.metadata_json or "{}"), shards=arrays,
                          dtypes=dtypes, shapes=shapes, _buffers=buffers, _finalizers=finalizers,
                          _loans=self._loans)


def _end_loan(client: Client, job: str, step: int, rank: int, generation: str) -> None:
    """End one loan of restored files (from the release thread; best effort)."""
    try:
        client._stub.Release(pb.ReleaseRequest(job=job, step=step, rank=rank, generation=generation),
                             timeout=client.timeout)
    except (grpc.RpcError, ValueError):  # daemon gone or channel closed: the files just stay out of the pool
        pass


def _release_held(client: Client, args: tuple, meta: str | None, fail: BaseException | None) -> None:
    """Commit (``meta``: the final metadata, None: as given) or abort (``fail``) a held save;
    ``args`` are its ``Client._finish`` arguments."""
    client._holding.discard(args[0])
    if meta is not None:
        args = (*args[:4], meta, *args[5:])
    client._committer.submit(functools.partial(client._finish, fail=fail), *args)


def _abort_held(holding: set[SaveFuture]) -> None:
    """Abort the held saves of a client that closes (nothing commits them any more)."""
    from .errors import FailedPreconditionError

    for held in list(holding):
        held.abort(FailedPreconditionError(f"{held.job} step {held.step} rank {held.rank}: the client closed "
                                           "before the held save was committed"))


def _encode_metadata(metadata: Mapping[str, Any] | None) -> str:
    if metadata is None:
        return "{}"
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError("metadata: must be a mapping (JSON object)")
    try:
        text = json.dumps(metadata, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"metadata: not JSON-serializable ({e})") from None
    if len(text) > MAX_METADATA_BYTES:
        raise InvalidArgumentError(f"metadata: larger than {MAX_METADATA_BYTES} bytes")
    return text
