"""gRPC servicer (thin: validate, delegate to :class:`Node`, map errors) and server assembly."""

from __future__ import annotations

import asyncio
import errno
import functools
import grpc
import json
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tierckpt.common import status as _status
from tierckpt.common.names import check_job, check_rank, check_shard, check_step
from tierckpt.errors import InvalidArgumentError, TierckptError
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

from . import __version__
from .config import DaemonConfig
from .node import Node

__all__ = ["TierckptServicer", "create_server", "Listening", "STREAM_CHUNK"]

log = logging.getLogger(__name__)

STREAM_CHUNK = 4 << 20

TIER_NAMES = {pb.TIER_LOCAL: "local", pb.TIER_PEER: "peer", pb.TIER_PERSISTENT: "persistent"}
TIER_ENUM = {v: k for k, v in TIER_NAMES.items()}


def _rpc(fn: Callable) -> Callable:
    """Map tierckpt exceptions to gRPC status codes (the one place it is done in the daemon)."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except TierckptError as e:
            code = _status.code_for(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", fn.__name__)
            await context.abort(code, str(e))
        except OSError as e:
            if e.errno == errno.ENOSPC:  # the local tier's filesystem is full: the capacity condition
                log.error("%s failed: local_dir is full: %s", fn.__name__, e)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"local_dir is full on node: {e.strerror or e}")
            log.exception("%s failed with an I/O error", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"I/O error on node: {e.strerror or e}")

    return wrapper


def _check_json_object(text: str, field: str) -> str:
    if not text:
        return "{}"
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(f"{field}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{field}: must be a JSON object")
    return text


class TierckptServicer(pb_grpc.TierckptServicer):
    def __init__(self, node: Node, config: DaemonConfig) -> None:
        self.node = node
        self.config = config

    @_rpc
    async def BeginSave(self, request: pb.BeginSaveRequest, context) -> pb.BeginSaveResponse:
        check_job(request.job)
        check_step(request.step)
        check_rank(request.rank, request.world_size)
        specs = []
        for s in request.shards:
            check_shard(s.name, "shards.name")
            specs.append((s.name, s.size, s.dtype, list(s.shape)))
        stream = request.transfer == pb.TRANSFER_STREAM
        st = await self.node.begin_save(request.job, request.step, request.rank, request.world_size, specs, stream)
        return pb.BeginSaveResponse(
            save_id=st.save_id,
            shards=[pb.StagedShard(name=f.name, path="" if stream else str(f.path), recycled=f.recycled)
                    for f in st.files.values()],
            fs_token=self.node.store.fs_token,
            local_dir=str(self.node.store.root),
        )

    @_rpc
    async def WriteShard(self, request_iterator: AsyncIterator[pb.WriteShardRequest], context) -> pb.WriteShardResponse:
        fds: dict = {}
        total = 0
        try:
            async for req in request_iterator:
                await asyncio.to_thread(self.node.store.write_chunk, req.save_id, req.shard, req.offset, req.data, fds)
                total += len(req.data)
        finally:
            for fd in fds.values():
                os.close(fd)
        return pb.WriteShardResponse(bytes_written=total)

    @_rpc
    async def CommitSave(self, request: pb.CommitSaveRequest, context) -> pb.CommitSaveResponse:
        if not request.save_id:
            raise InvalidArgumentError("save_id: required")
        digests: dict[str, str] = {}
        for d in request.digests:
            check_shard(d.name, "digests.name")
            if d.name in digests:
                raise InvalidArgumentError(f"digests.name: {d.name!r} appears twice")
            digests[d.name] = d.checksum
        meta = _check_json_object(request.metadata_json, "metadata_json")
        man, seconds = await self.node.commit_save(request.save_id, digests, meta, request.persist)
        return pb.CommitSaveResponse(bytes=man.nbytes, commit_seconds=seconds)

    @_rpc
    async def AbortSave(self, request: pb.AbortSaveRequest, context) -> pb.AbortSaveResponse:
        await self.node.abort_save(request.save_id)
        return pb.AbortSaveResponse()

    @_rpc
    async def WaitTier(self, request: pb.WaitTierRequest, context) -> pb.WaitTierResponse:
        tier = TIER_NAMES.get(request.tier)
        if tier is None:
            raise InvalidArgumentError("tier: must be TIER_LOCAL, TIER_PEER or TIER_PERSISTENT")
        remaining = context.time_remaining()
        timeout = request.timeout_seconds or remaining
        if timeout is not None and timeout <= 0:
            raise InvalidArgumentError("timeout_seconds: must be positive")
        nodes = await self.node.wait_tier(request.job, request.step, request.rank, tier, timeout)
        return pb.WaitTierResponse(nodes=nodes)

    @_rpc
    async def Latest(self, request: pb.LatestRequest, context) -> pb.LatestResponse:
        step = await self.node.latest(request.job)
        return pb.LatestResponse(found=step is not None, step=step or 0)

    @_rpc
    async def List(self, request: pb.ListRequest, context) -> pb.ListResponse:
        views = await self.node.views(request.job)
        out = []
        for step in sorted(views):
            v = views[step]
            out.append(pb.CheckpointInfo(
                step=step, world_size=v.world_size, complete=v.complete, created_unix=v.created,
                tiers=[TIER_ENUM[t] for t in v.complete_in()],
                ranks=[pb.RankLocation(rank=r.rank, tiers=[TIER_ENUM[t] for t in ("local", "peer", "persistent")
                                                            if t in r.tiers],
                                       nodes=sorted(r.nodes), bytes=r.nbytes)
                       for r in sorted(v.ranks.values(), key=lambda r: r.rank)],
            ))
        return pb.ListResponse(checkpoints=out)

    @_rpc
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreResponse:
        check_job(request.job)
        step = request.step if request.has_step else None
        res = await self.node.restore(request.job, request.rank, step, local_corrupt=request.local_corrupt,
                                      corrupt_generation=request.corrupt_generation)
        man = res.manifest
        shared = request.transfer != pb.TRANSFER_STREAM
        return pb.RestoreResponse(
            step=man.step, tier=TIER_ENUM[res.tier], world_size=man.world_size,
            metadata_json=man.metadata_json, fs_token=self.node.store.fs_token, source_node=res.source_node,
            local_dir=str(self.node.store.root), generation=man.generation,
            shards=[pb.RestoredShard(name=s.name, size=s.size, checksum=s.checksum, dtype=s.dtype,
                                     shape=list(s.shape), path=p if shared else "")
                    for s, p in zip(man.shards, res.paths)],
        )

    async def ReadShard(self, request: pb.ReadShardRequest, context) -> AsyncIterator[pb.ReadShardResponse]:
        try:
            check_job(request.job)
            check_shard(request.shard)
            man = self.node.store.get(request.job, request.step, request.rank)
            if man is None:
                raise _not_found(request)
            try:
                entry = man.shard(request.shard)
            except KeyError:
                raise _not_found(request) from None
            path = self.node.store.lend(man)[[s.name for s in man.shards].index(entry.name)]
            fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
        except TierckptError as e:
            await context.abort(_status.code_for(e), str(e))
            return
        except FileNotFoundError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.job} step {request.step} was evicted")
            return
        try:
            offset = 0
            while offset < entry.size:
                data = await asyncio.to_thread(os.pread, fd, min(STREAM_CHUNK, entry.size - offset), offset)
                if not data:
                    break
                yield pb.ReadShardResponse(offset=offset, data=data)
                offset += len(data)
        except OSError as e:
            log.error("ReadShard %s step %d rank %d %s: %s", request.job, request.step, request.rank,
                      request.shard, e)
            await context.abort(grpc.StatusCode.INTERNAL, f"I/O error on node reading shard: {e.strerror or e}")
        finally:
            os.close(fd)

    @_rpc
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        st = self.node.status()
        u = st["usage"]
        resp = pb.StatusResponse(
            node_id=st["node_id"], version=__version__, local_dir=str(self.node.store.root),
            capacity_bytes=u.capacity, used_bytes=u.used, staging_bytes=u.staging, recycle_bytes=u.recycle,
            replicas=self.config.replicas, persistent_url=self.config.persistent, uptime_seconds=st["uptime"],
        )
        for j in st["jobs"]:
            resp.jobs.append(pb.JobStatus(job=j["job"], steps=j["steps"], has_latest=j["latest"] is not None,
                                          latest=j["latest"] or 0, bytes=j["bytes"]))
        for p in st.get("peer", {}).get("peers", []):
            resp.peers.append(pb.PeerStatus(**p))
        drain = st.get("persistent", {})
        resp.drain_backlog_bytes = int(drain.get("backlog_bytes", 0))
        resp.drain_backlog_steps = int(drain.get("backlog_steps", 0))
        resp.drain_oldest_age_seconds = float(drain.get("oldest_age_seconds", 0.0))
        return resp


def _not_found(request: pb.ReadShardRequest):
    from tierckpt.errors import NotFoundError

    return NotFoundError(f"{request.job} step {request.step} rank {request.rank} shard {request.shard!r} "
                         "is not in the local tier (call Restore first)")


@dataclass
class Listening:
    server: grpc.aio.Server
    tcp_port: int | None
    socket_path: str | None


def server_options(config: DaemonConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]


async def create_server(config: DaemonConfig, node: Node, extra_servicers: Callable[[grpc.aio.Server], None] | None = None,
                        server_credentials: grpc.ServerCredentials | None = None) -> Listening:
    """Build and start the gRPC server on the configured listeners. Port 0 picks a free port."""
    server = grpc.aio.server(options=server_options(config))
    pb_grpc.add_TierckptServicer_to_server(TierckptServicer(node, config), server)
    if extra_servicers:
        extra_servicers(server)
    tcp_port = None
    if config.listen:
        if server_credentials is not None:
            tcp_port = server.add_secure_port(config.listen, server_credentials)
        else:
            tcp_port = server.add_insecure_port(config.listen)
    sock = None
    if config.socket:
        sock = os.path.abspath(config.socket)
        os.makedirs(os.path.dirname(sock), exist_ok=True)
        if os.path.exists(sock):
            os.unlink(sock)  # a stale socket of a dead daemon
        server.add_insecure_port("unix://" + sock)
    await server.start()
    if sock:
        os.chmod(sock, config.socket_mode)
        if config.socket_group:
            import grp
            import shutil as _sh

            gid = int(config.socket_group) if config.socket_group.isdigit() else grp.getgrnam(config.socket_group).gr_gid
            _sh.chown(sock, group=gid)
    return Listening(server, tcp_port, sock)
