"""The receiving side of the peer tier: inbound replicas and read tickets, served over the bulk port.

``PrepareReplica`` opens a staging area in the local store and issues a "put" ticket; the bulk
connections write the shards into it while :class:`~.bulk.OrderedHasher` hashes them in byte
order; ``CommitReplica`` checks every checksum and commits through the local commit protocol
(manifest last). ``OpenRead`` issues a "get" ticket for a held rank. Inbound replicas pause
while this node restores (a replacement node's trainers wait on the restore).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import (
    AbortedError,
    CapacityError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TierckptError,
)
from tierckpt.v1 import peer_pb2 as ppb

from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import LocalStore, Staging
from ..offload import run_blocking, run_owning
from . import bulk
from .blobs import BlobTickets

__all__ = ["Receiver", "check_digest"]

log = logging.getLogger(__name__)


def check_digest(man: Manifest, shard: str, actual: str, what: str, metrics: Any = None) -> None:
    """Raise DataLossError (and count it) if ``actual`` is not the manifest's checksum of ``shard``."""
    expected = man.shard(shard).checksum
    if actual != expected:
        if metrics:
            metrics.checksum_failures.labels(tier="peer").inc()
        raise DataLossError(f"checksum mismatch for {man.job}/{man.step}/rank {man.rank}/{shard} ({what}): "
                            f"expected {expected}, got {actual}")


@dataclass(eq=False)
class _Inbound:
    """A replica being received: its staging area and the pieces that arrived."""

    ticket: str
    man: Manifest
    staging: Staging
    sender: str
    hashers: dict[str, bulk.OrderedHasher]
    created: float = field(default_factory=time.monotonic)
    active: float = field(default_factory=time.monotonic)  # the last byte (or request) seen

    def touch(self) -> None:
        self.active = time.monotonic()


@dataclass
class _Reader:
    """A read ticket: one transfer of one rank. Each byte of each shard is served once; the
    ticket ends when every byte was (or read_ticket_ttl after its last use)."""

    man: Manifest
    created: float  # monotonic time of the last use: a ticket expires read_ticket_ttl after it
    requester: str = ""
    served: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # shard -> sorted [start, end)
    left: int = -1  # bytes not served yet (-1: not counted yet)

    def take(self, shard: str, ranges: list[tuple[int, int]]) -> bool:
        """Claim ``ranges`` (start, length) of ``shard``; raise if any byte was served already.
        Returns whether the whole rank has now been served (the ticket is spent)."""
        if self.left < 0:
            self.left = sum(max(1, s.size) for s in self.man.shards)
        spans = self.served.setdefault(shard, [])
        starts = [a for a, _ in spans]
        for start, length in ranges:
            end = start + max(1, length)  # a zero-size shard counts as one "byte": read once
            i = bisect.bisect_right(starts, start)
            if (i and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
                raise FailedPreconditionError(f"ticket: bytes of {shard!r} at {start} were already read with this "
                                              "ticket (a read ticket serves one transfer; ask OpenRead again)")
            spans.insert(i, (start, end))
            starts.insert(i, start)
            self.left -= end - start
        return self.left <= 0


class Receiver:
    """Inbound replicas, read tickets and the bulk server's request handler.

    Args:
        store: the local store.
        announce: called with the local manifest of every copy committed here.
        staging_timeout: seconds an unfinished inbound replica is kept.
        metrics: optional metrics.
    """

    def __init__(self, node_id: str, store: LocalStore, announce: Callable[[Manifest], None], staging_timeout: float,
                 metrics: Any = None, *, check_identity: Callable[[socket.socket, str], None] | None = None) -> None:
        self.node_id = node_id
        self.store = store
        self.announce = announce
        self.staging_timeout = staging_timeout
        self.metrics = metrics
        self.bulk_port = 0
        self._inbound: dict[str, _Inbound] = {}
        self._readers: dict[str, _Reader] = {}
        self._lock = threading.Lock()  # guards _inbound and _readers (bulk threads use them)
        self._restoring = 0  # fetches in progress: inbound replicas give way to them
        self._restore_cv = threading.Condition()
        # ranks a restore is bringing in, from any tier (not to be staged twice): key -> restores
        self.fetching: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self.check_identity = check_identity  # under mTLS: the connection's certificate names the ticket's node
        self.blobs = BlobTickets()  # parity slots a restoring node pulls to decode a chunk itself

    @contextlib.contextmanager
    def fetching_rank(self, key: tuple[str, int, int]) -> Iterator[None]:
        """While a restore brings ``key`` into the local store, inbound replicas of it are refused
        (the owner retries): both would stage the same rank and one would void the other."""
        self.fetching[key] += 1
        try:
            yield
        finally:
            self.fetching[key] -= 1
            if self.fetching[key] <= 0:
                del self.fetching[key]

    # ------------------------------------------------------------------------------ replicas

    async def prepare(self, sender: str, manifest_json: str, allowed: Callable[[Manifest], None] | None = None, *,
                      link: bool = False) -> ppb.PrepareReplicaResponse:
        """Open a staging area for a replica and issue its bulk "put" ticket (PrepareReplica RPC).

        ``link``: the sender skips the shards the answer lists as linked (see :meth:`_begin_replica`).

        Raises:
            InvalidArgumentError: the manifest is malformed.
            FailedPreconditionError: this node saved the rank itself (a copy never replaces it),
                or is restoring it right now.
            CapacityError: the local tier cannot hold the replica.
        """
        try:
            man = Manifest.from_json(manifest_json)
        except DataLossError as e:
            raise InvalidArgumentError(f"manifest_json: {e}") from None
        if allowed is not None:
            allowed(man)  # PermissionDeniedError: not this node's to hold
        cur = self.store.get(*man.key)
        if cur is not None and cur.generation == man.generation:
            return ppb.PrepareReplicaResponse(already_committed=True)
        if man.key in self.fetching:  # a restore is bringing it in; the owner retries after
            raise FailedPreconditionError(f"{man.job} step {man.step} rank {man.rank} is being restored on "
                                          f"{self.node_id}")
        if cur is not None and cur.node == self.node_id != man.node:
            raise FailedPreconditionError(f"{man.job} step {man.step} rank {man.rank} was saved on {self.node_id}; "
                                          f"refusing a copy owned by {man.node}")
        st = await self._begin_replica(man, link)
        linked = [f.name for f in st.files.values() if f.shared]
        ticket = secrets.token_urlsafe(18)
        with self._lock:
            self._inbound[ticket] = _Inbound(ticket, man, st, sender, {
                s.name: bulk.OrderedHasher(s.size) for s in man.shards if not st.files[s.name].shared})
        if linked and self.metrics:
            self.metrics.shared_bytes.labels(tier="peer").inc(sum(st.files[n].size for n in linked))
        return ppb.PrepareReplicaResponse(ticket=ticket, bulk_port=self.bulk_port, linked=linked)

    async def _begin_replica(self, man: Manifest, link: bool) -> Staging:
        """The replica's staging area. With ``link``, shards byte-identical to a copy held here
        (same job and rank, name, size, layout and checksum) are linked, not sent (see links.py)."""
        specs = [(s.name, s.size, s.dtype, s.shape) for s in man.shards]
        sums = {s.name: s.checksum for s in man.shards} if link else {}
        return await run_owning(self.store.begin, self.store.abort_staging, man.job, man.step, man.rank,
                                man.world_size, specs, prefault=True, unchanged=list(sums), checksums=sums,
                                job_owner=man.job_owner)

    async def commit(self, ticket: str) -> int:
        """Check every shard arrived whole with its checksum, then commit (CommitReplica RPC).

        Returns:
            The bytes committed.

        Raises:
            FailedPreconditionError: unknown or expired ticket.
            InvalidArgumentError: a shard is incomplete.
            DataLossError: a checksum mismatch (the staging area is dropped).
        """
        with self._lock:
            inb = self._inbound.pop(ticket, None)
        if inb is None:
            raise FailedPreconditionError("ticket: unknown, expired or already committed replica ticket")
        man = inb.man
        try:
            for s in man.shards:
                h = inb.hashers.get(s.name)
                if h is None:  # linked from a committed copy with this checksum
                    continue
                if not h.complete:
                    raise InvalidArgumentError(f"shard {s.name!r}: {h.pos} of {s.size} bytes received in order")
                check_digest(man, s.name, h.hexdigest(), f"replica from {inb.sender}", self.metrics)
            local = await self.commit_copy(inb.staging, man)
        except BaseException:
            await run_blocking(self.store.abort, inb.staging.save_id)
            raise
        log.info("committed replica of %s step %d rank %d from %s (%d bytes)", man.job, man.step, man.rank,
                 inb.sender, man.nbytes)
        self.announce(local)
        return local.nbytes

    async def commit_copy(self, staging: Staging, man: Manifest) -> Manifest:
        """Commit a verified copy of ``man`` (a replica or a fetch) under the owner's identity."""
        local, _ = await run_blocking(
            self.store.commit, staging.save_id, {s.name: s.checksum for s in man.shards}, man.metadata_json,
            persist=man.persist, verify=False, node=man.node, generation=man.generation, created=man.created)
        return local

    def abort(self, ticket: str) -> None:
        """Drop an unfinished replica (AbortReplica RPC; blocking). Idempotent."""
        with self._lock:
            inb = self._inbound.pop(ticket, None)
        if inb is not None:
            self.store.abort(inb.staging.save_id)

    def sender_of(self, ticket: str) -> str:
        with self._lock:
            inb = self._inbound.get(ticket)
        return inb.sender if inb is not None else ""

    def open_read(self, job: str, step: int, rank: int, requester: str = "") -> ppb.OpenReadResponse:
        """Describe a held rank and issue a bulk "get" ticket for it (OpenRead RPC).

        Raises:
            NotFoundError: the rank is not held here.
        """
        man = self.store.get(job, step, rank)
        if man is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not held by node {self.node_id}")
        ticket = secrets.token_urlsafe(18)
        with self._lock:
            self._readers[ticket] = _Reader(man, time.monotonic(), requester)
        return ppb.OpenReadResponse(manifest_json=man.to_json().decode(), ticket=ticket, bulk_port=self.bulk_port)

    def expire(self) -> None:
        """Drop inbound replicas past the staging timeout or idle for ``KNOBS.inbound_idle_timeout``
        (a sender that died between two connections), and stale read tickets (blocking)."""
        now = time.monotonic()
        idle = KNOBS.inbound_idle_timeout or float("inf")
        self.blobs.expire()
        with self._lock:
            stale = [t for t, i in self._inbound.items()
                     if now - i.created > self.staging_timeout or now - i.active > idle]
            dropped = [self._inbound.pop(t) for t in stale]
            for t in [t for t, r in self._readers.items() if now - r.created > KNOBS.read_ticket_ttl]:
                del self._readers[t]
        for inb in dropped:
            log.warning("dropped the unfinished replica of %s step %d rank %d from %s (idle or expired)",
                        inb.man.job, inb.man.step, inb.man.rank, inb.sender)
            try:
                self.store.abort(inb.staging.save_id)
            except OSError:  # the store's own expiry reclaims it later; the others go now
                log.exception("could not drop the staging area of %s", inb.staging.save_id)

    def _drop_broken(self, inb: _Inbound, err: OSError) -> None:
        """A bulk connection of ``inb`` broke: fail its other connections and drop its staging now."""
        for h in inb.hashers.values():
            h.abort(f"a connection of this replica broke: {err}")
        with self._lock:
            if self._inbound.get(inb.ticket) is not inb:
                return
            del self._inbound[inb.ticket]
        log.warning("dropped the partial replica of %s step %d rank %d from %s: its connection broke (%s)",
                    inb.man.job, inb.man.step, inb.man.rank, inb.sender, err)
        self.store.abort(inb.staging.save_id)

    # ------------------------------------------------------------------------------ restores

    def restore_begun(self, delta: int) -> None:
        with self._restore_cv:
            self._restoring += delta
            self._restore_cv.notify_all()

    def restoring(self) -> int:
        """Restores in progress on this node (other inbound transfers give way to them)."""
        with self._restore_cv:
            return self._restoring

    def _yield_to_restores(self) -> None:
        """Inbound replicas pause while this node restores. Bounded, so the sender never times out."""
        with self._restore_cv:
            self._restore_cv.wait_for(lambda: self._restoring == 0, timeout=bulk.IO_TIMEOUT / 3)

    # ------------------------------------------------------------------------------ bulk server

    def serve_bulk(self, sock: socket.socket, req: dict, buf: bytearray) -> None:
        """Serve one bulk request (a bulk thread). Errors are answered, then close the connection.

        Under mTLS the connection's certificate must name the node the ticket was issued to
        (the replica's sender, the reader's requester)."""
        try:
            op, ticket, shard = req.get("op"), str(req.get("ticket", "")), str(req.get("shard", ""))
            piece = (req.get("offset"), req.get("chunk"), req.get("stride"))
            if op == "put":
                self._put(sock, ticket, shard, piece, buf)
            elif op == "get":
                self._get(sock, ticket, shard, piece, buf)
            else:
                raise InvalidArgumentError(f"op: {op!r} must be put or get")
        except TierckptError as e:
            bulk.send_msg(sock, bulk.error_msg(e))
            raise

    def _check_holder(self, sock: socket.socket, node_id: str) -> None:
        if self.check_identity is not None and node_id:
            self.check_identity(sock, node_id)

    def _put(self, sock: socket.socket, ticket: str, shard: str, piece: tuple[Any, Any, Any], buf: bytearray) -> None:
        with self._lock:
            inb = self._inbound.get(ticket)
        if inb is None:
            raise FailedPreconditionError("ticket: unknown or expired replica ticket")
        self._check_holder(sock, inb.sender)
        f = inb.staging.files.get(shard)
        if f is None or f.shared:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of this replica, or was linked here")
        bulk.check_piece(*piece, f.size)
        try:
            fd = self.store.open_staged(inb.staging.save_id, shard)
        except (FileNotFoundError, InvalidArgumentError, AbortedError):
            raise FailedPreconditionError("ticket: the replica's staging area was aborted or expired") from None
        hasher = inb.hashers[shard]
        inb.touch()

        def update(off: int, data: Any) -> None:
            inb.touch()
            hasher.update(off, data)

        runs = list(bulk.runs(*piece, f.size))
        try:
            bulk.send_msg(sock, {"ok": True})
            for i, (start, length) in enumerate(runs):
                try:
                    bulk.recv_range(sock, fd, start, length, buf, update, self._yield_to_restores, keep_in_step=True)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    for _, rest in runs[i + 1:]:  # the sender's piece, received and dropped
                        bulk.discard(sock, rest, buf)
                    self._drop_broken(inb, e)
                    bulk.send_msg(sock, bulk.error_msg(CapacityError(
                        f"local_dir is full on node {self.node_id}: {e.strerror or e}")))
                    return
        except OSError as e:
            self._drop_broken(inb, e)
            raise
        finally:
            os.close(fd)
        inb.touch()
        bulk.send_msg(sock, {"ok": True})

    def _get(self, sock: socket.socket, ticket: str, shard: str, piece: tuple[Any, Any, Any], buf: bytearray) -> None:
        if self.blobs.holds(ticket):
            self.blobs.serve(sock, ticket, shard, piece, buf, self._check_holder)
            return
        now = time.monotonic()
        with self._lock:
            rd = self._readers.get(ticket)
            if rd is not None and now - rd.created > KNOBS.read_ticket_ttl:
                del self._readers[ticket]
                rd = None
            if rd is not None:
                rd.created = now
        if rd is None:
            raise FailedPreconditionError("ticket: unknown, expired or spent read ticket")
        self._check_holder(sock, rd.requester)
        try:
            entry = rd.man.shard(shard)
        except KeyError:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of this rank") from None
        bulk.check_piece(*piece, entry.size)
        ranges = list(bulk.runs(*piece, entry.size))
        with self._lock:
            if rd.take(shard, ranges) and self._readers.get(ticket) is rd:
                del self._readers[ticket]  # every byte handed out: the ticket is spent
        fh = os.fdopen(self.store.open_shard(rd.man, shard), "rb")  # NotFoundError: evicted since
        with fh, self.store.warm.sending():
            bulk.send_msg(sock, {"ok": True, "length": sum(n for _, n in ranges)})
            for start, length in ranges:
                bulk.send_range(sock, fh, start, length, buf)

