"""gRPC servicer (thin: validate, delegate to :class:`Node`, map errors) and server assembly."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from tierckpt.common.names import MAX_METADATA_BYTES, check_job, check_rank, check_shard, check_step
from tierckpt.errors import InvalidArgumentError
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

from . import __version__
from .access import ClientAccess, tcp_owner
from .config import ConfigError, DaemonConfig
from .datamgmt import TIERS, DataManagement
from .knobs import KNOBS
from .local.policies import JobPolicy
from .node import Node
from .rpc import Authorizing, add_service, check_decoded, rpc, rpc_stream
from .tierhealth import TierHealth
from .unixsock import SocketClaim, claim_socket, resolve_group

__all__ = ["TierckptServicer", "create_server", "check_listen", "Listening"]

log = logging.getLogger(__name__)

TIER_NAMES = {pb.TIER_LOCAL: "local", pb.TIER_PEER: "peer", pb.TIER_PERSISTENT: "persistent"}
TIER_ENUM = {v: k for k, v in TIER_NAMES.items()}


def _check_json_object(text: str, field: str) -> str:
    """A JSON object of at most MAX_METADATA_BYTES (checked before parsing), or InvalidArgumentError."""
    if not text:
        return "{}"
    if len(text) > MAX_METADATA_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_METADATA_BYTES:
        raise InvalidArgumentError(f"{field}: larger than {MAX_METADATA_BYTES} bytes")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(f"{field}: not valid JSON ({e})") from None
    except RecursionError:
        raise InvalidArgumentError(f"{field}: nested too deeply") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{field}: must be a JSON object")
    return text


def _check_unchanged(request: pb.BeginSaveRequest, names: set[str]) -> tuple[int, str, list[str]] | None:
    """(base_step, base_generation, unchanged) of a BeginSave, or None without ``unchanged``.

    Raises:
        InvalidArgumentError: an unchanged name that is not one of the save's shards.
    """
    if not request.unchanged:
        return None
    check_step(request.base_step)
    unknown = sorted(set(request.unchanged) - names)
    if unknown:
        raise InvalidArgumentError(f"unchanged: {[n[:64] for n in unknown[:8]]} not among the save's shards")
    if len(request.base_generation) > 64:
        raise InvalidArgumentError("base_generation: at most 64 characters")
    return request.base_step, request.base_generation, list(request.unchanged)


class TierckptServicer(pb_grpc.TierckptServicer, Authorizing):
    """The client service. ``access`` is set on the TCP listener's instance: callers there are
    bound by their certificate identity (:mod:`tierckptd.access`); Unix-socket callers are not."""

    def __init__(self, node: Node, config: DaemonConfig, tier_health: TierHealth | None = None,
                 access: ClientAccess | None = None, tenant: str = "") -> None:
        self.node = node
        self.config = config
        self.tier_health = tier_health
        self.data = DataManagement(node)
        self.access = access
        self.tenant = tenant  # the job owner a Unix-socket caller acts as (the socket's tenant)

    def owner(self, context: object) -> str:
        """The identity a call acts as: its client certificate's name over TCP, the socket's tenant
        on a Unix socket (DESIGN.md, trust model: a job belongs to the identity that first saved it).
        Writes (save, rm, policy, persist) are that identity's own jobs only."""
        return tcp_owner(context) if self.access is not None else self.tenant

    def reader(self, context: object, job: str) -> str:
        """Whose steps of ``job`` a read (latest, ls, availability, restore) counts. A socket's
        callers read their tenant's jobs only. A TCP client reads what ``client_jobs`` lets it use
        (every job without it): the steps of the job's owner on this node, or, where this node
        holds none of the job, its own."""
        if self.access is None:
            return self.tenant
        held = self.node.store.job_owner(job)
        return held if held is not None else tcp_owner(context)

    def authorize(self, request: object, context: object) -> None:
        """Called by :func:`rpc` before every unary method: the job and the save it names must
        be the caller's (TCP listener only)."""
        if self.access is None:
            return
        if self.config.tls_enabled:
            from . import revocation, tls

            role = tls.peer_role(context)
            revocation.check_names(self.config, role.all_names if role else set())
        job = getattr(request, "job", None)
        if isinstance(job, str) and job:
            self.access.check_job(context, job)
        save_id = getattr(request, "save_id", None)
        if isinstance(save_id, str) and save_id:
            self.access.check_save(context, save_id)

    @rpc
    async def BeginSave(self, request: pb.BeginSaveRequest, context) -> pb.BeginSaveResponse:
        check_job(request.job)
        check_step(request.step)
        check_rank(request.rank, request.world_size)
        specs = []
        for s in request.shards:
            check_shard(s.name, "shards.name")
            specs.append((s.name, s.size, s.dtype, list(s.shape)))
        stream = request.transfer == pb.TRANSFER_STREAM
        share = _check_unchanged(request, {s[0] for s in specs})
        owner = self.owner(context)
        if self.access is None:
            st = await self.node.begin_save(request.job, request.step, request.rank, request.world_size, specs, stream,
                                            share=share, job_owner=owner)
        else:
            access = self.access
            evictable = (lambda job: access.visible(context, job)) if access.rules else None
            with self.access.beginning(context, self.node.store.is_open) as begun:
                st = await self.node.begin_save(request.job, request.step, request.rank, request.world_size, specs,
                                                stream, evictable, share=share, job_owner=owner)
                begun.append(st.save_id)
        return pb.BeginSaveResponse(
            save_id=st.save_id,
            shards=[pb.StagedShard(name=f.name, path="" if stream or f.shared else str(f.path),
                                   recycled=(f.recycled and not f.warm) or f.reserved, shared=f.shared)
                    for f in st.files.values()],
            fs_token=self.node.fs_token,
            local_dir=self.node.local_dir,
        )

    @rpc
    async def WriteShard(self, request_iterator: AsyncIterator[pb.WriteShardRequest], context) -> pb.WriteShardResponse:
        async def pieces() -> AsyncIterator[tuple[str, str, int, bytes]]:
            async for raw in request_iterator:
                req = check_decoded(raw)
                if self.access is not None:
                    self.access.check_save(context, req.save_id)
                yield req.save_id, req.shard, req.offset, req.data

        return pb.WriteShardResponse(bytes_written=await self.node.write_stream(pieces()))

    @rpc
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
        if request.HasField("policy"):
            await self.data.commit_policy(request.save_id, policy_from_pb(request.policy))
        man, seconds = await self.node.commit_save(request.save_id, digests, meta, request.persist)
        return pb.CommitSaveResponse(bytes=man.nbytes, commit_seconds=seconds)

    @rpc
    async def AbortSave(self, request: pb.AbortSaveRequest, context) -> pb.AbortSaveResponse:
        await self.node.abort_save(request.save_id)
        return pb.AbortSaveResponse()

    @rpc
    async def WaitTier(self, request: pb.WaitTierRequest, context) -> pb.WaitTierResponse:
        tier = TIER_NAMES.get(request.tier)
        if tier is None:
            raise InvalidArgumentError("tier: must be TIER_LOCAL, TIER_PEER or TIER_PERSISTENT")
        if not math.isfinite(request.timeout_seconds) or request.timeout_seconds < 0:
            raise InvalidArgumentError(f"timeout_seconds: {request.timeout_seconds!r} must be a finite number >= 0")
        remaining = context.time_remaining()
        timeout = request.timeout_seconds or remaining
        if timeout is not None and timeout <= 0:
            raise InvalidArgumentError("timeout_seconds: must be positive")
        nodes = await self.node.wait_tier(request.job, request.step, request.rank, tier, timeout)
        return pb.WaitTierResponse(nodes=nodes)

    @rpc
    async def Latest(self, request: pb.LatestRequest, context) -> pb.LatestResponse:
        step, gaps = await self.node.views.latest_with_gaps(request.job, self.reader(context, request.job))
        return pb.LatestResponse(found=step is not None, step=step or 0, unreachable=gaps)

    @rpc
    async def Availability(self, request: pb.AvailabilityRequest, context) -> pb.AvailabilityResponse:
        steps, gaps = await self.node.views.availability(request.job, request.rank,
                                                         self.reader(context, request.job))
        return pb.AvailabilityResponse(unreachable=gaps, steps=[
            pb.StepAvailability(step=v.step, world_size=v.world_size, nodes=sorted(v.ranks[request.rank].nodes),
                                tiers=[TIER_ENUM[t] for t in ("local", "peer", "persistent")
                                       if t in v.ranks[request.rank].tiers])
            for v in steps])

    @rpc
    async def List(self, request: pb.ListRequest, context) -> pb.ListResponse:
        views = await self.node.views.steps(request.job, self.reader(context, request.job))
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

    @rpc
    async def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreResponse:
        check_job(request.job)
        step = request.step if request.has_step else None
        shared = request.transfer != pb.TRANSFER_STREAM
        res = await self.node.restore(request.job, request.rank, step, local_corrupt=request.local_corrupt,
                                      corrupt_generation=request.corrupt_generation, lend=shared,
                                      job_owner=self.reader(context, request.job))
        man = res.manifest
        return pb.RestoreResponse(
            step=man.step, tier=TIER_ENUM[res.tier], world_size=man.world_size,
            metadata_json=man.metadata_json, fs_token=self.node.fs_token, source_node=res.source_node,
            local_dir=self.node.local_dir, generation=man.generation,
            shards=[pb.RestoredShard(name=s.name, size=s.size, checksum=s.checksum, dtype=s.dtype,
                                     shape=list(s.shape), path=p if shared else "")
                    for s, p in zip(man.shards, res.paths)],
        )

    @rpc
    async def RestoreProgress(self, request: pb.RestoreProgressRequest, context) -> pb.RestoreProgressResponse:
        check_job(request.job)
        if request.has_step:
            check_step(request.step)
        f = self.node.restore_progress(request.job, request.rank, request.step if request.has_step else None)
        if f is None:
            return pb.RestoreProgressResponse(fetching=False)
        return pb.RestoreProgressResponse(fetching=True, step=f.step, tier=TIER_ENUM[f.tier], bytes_done=f.bytes_done(),
                                          bytes_total=f.total, source=f.source)

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        check_job(request.job)
        check_step(request.step)
        if not request.generation or len(request.generation) > 64:
            raise InvalidArgumentError("generation: the RestoreResponse.generation of the released copy is required")
        return pb.ReleaseResponse(released=await self.node.release(request.job, request.step, request.rank,
                                                                   request.generation))

    @rpc_stream
    async def ReadShard(self, request: pb.ReadShardRequest, context) -> AsyncIterator[pb.ReadShardResponse]:
        check_job(request.job)
        check_step(request.step)
        check_shard(request.shard)
        self.node.store.check_owner(request.job, self.reader(context, request.job), "read")
        async for offset, data in self.node.read_shard(request.job, request.step, request.rank, request.shard):
            yield pb.ReadShardResponse(offset=offset, data=data)

    @rpc
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        st = self.node.status()
        u = st["usage"]
        resp = pb.StatusResponse(
            node_id=st["node_id"], version=__version__, local_dir=self.node.local_dir,
            capacity_bytes=u.capacity, used_bytes=u.charged, staging_bytes=u.staging_charged,
            recycle_bytes=u.recycle_charged, reserve_bytes=u.reserve_charged, reserve_target_bytes=u.reserve_target,
            reserve_ready_bytes=u.reserve_ready, reserve_taken_bytes=u.reserve_taken,
            replicas=self.config.replicas, persistent_url=self.config.persistent, uptime_seconds=st["uptime"],
            fs_token=self.node.fs_token, now_unix=time.time(),
        )
        for j in st["jobs"]:
            if self.access is not None and not self.access.visible(context, j["job"]):
                continue
            resp.jobs.append(pb.JobStatus(job=j["job"], steps=j["steps"], has_latest=j["latest"] is not None,
                                          latest=j["latest"] or 0, bytes=j["bytes"]))
        for p in st.get("peer", {}).get("peers", []):
            resp.peers.append(pb.PeerStatus(**p))
        drain = st.get("persistent", {})
        resp.drain_backlog_bytes = int(drain.get("backlog_bytes", 0))
        resp.drain_backlog_steps = int(drain.get("backlog_steps", 0))
        resp.drain_oldest_age_seconds = float(drain.get("oldest_age_seconds", 0.0))
        if self.tier_health is not None:
            resp.persistent_error = self.tier_health.error("persistent") or ""
        return resp


    @rpc
    async def SetJobPolicy(self, request: pb.SetJobPolicyRequest, context) -> pb.JobPolicyResponse:
        check_job(request.job)
        self.node.store.check_owner(request.job, self.owner(context), "set a policy of")
        await self.data.set_policy(request.job, policy_from_pb(request.policy), reset=request.reset)
        return self._policy_response(request.job)

    @rpc
    async def GetJobPolicy(self, request: pb.GetJobPolicyRequest, context) -> pb.JobPolicyResponse:
        check_job(request.job)
        return self._policy_response(request.job)

    def _policy_response(self, job: str) -> pb.JobPolicyResponse:
        pols = self.node.store.policies
        return pb.JobPolicyResponse(job=job, policy=policy_to_pb(pols.get(job)),
                                    effective=policy_to_pb(pols.effective(job)))

    @rpc
    async def DeleteStep(self, request: pb.DeleteStepRequest, context) -> pb.DeleteStepResponse:
        check_job(request.job)
        check_step(request.step)
        tiers = _tier_names(request.tiers.tiers)
        owner = self.owner(context)
        self.node.store.check_owner(request.job, owner, "delete a step of")
        c = await self.data.delete_step(request.job, request.step, tiers, owner)
        return pb.DeleteStepResponse(local_ranks=c.local, peer_ranks=c.peer, persistent_ranks=c.persistent,
                                     persistent_objects=c.persistent_objects, unreachable=c.unreachable)

    @rpc
    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        check_job(request.job)
        step = request.step if request.has_step else None
        if step is not None:
            check_step(step)
        checks, unreachable = await self.data.verify(request.job, step)
        states = {"ok": pb.COPY_STATE_OK, "mismatch": pb.COPY_STATE_MISMATCH, "missing": pb.COPY_STATE_MISSING}
        return pb.VerifyResponse(
            copies=[pb.CopyCheck(step=c.step, rank=c.rank, tier=TIER_ENUM[c.tier], node=c.node, state=states[c.state],
                                 detail=c.detail) for c in checks],
            mismatches=sum(1 for c in checks if c.state == "mismatch"), unreachable=unreachable)

    @rpc
    async def PersistStep(self, request: pb.PersistStepRequest, context) -> pb.PersistStepResponse:
        check_job(request.job)
        check_step(request.step)
        if not math.isfinite(request.timeout_seconds) or request.timeout_seconds < 0:
            raise InvalidArgumentError(f"timeout_seconds: {request.timeout_seconds} must be >= 0")
        self.node.store.check_owner(request.job, self.owner(context), "persist")
        queued, done = await self.data.persist_step(request.job, request.step, wait=request.wait,
                                                    timeout=request.timeout_seconds or None)
        return pb.PersistStepResponse(queued=queued, persisted=done)


def policy_from_pb(p: pb.JobPolicy) -> JobPolicy:
    """The fields present in ``p`` (checked: InvalidArgumentError names a bad one)."""
    return JobPolicy(**{k: getattr(p, k) for k in ("keep_local", "keep_persistent", "persist_every", "redundancy")
                        if p.HasField(k)}).checked()  # type: ignore[arg-type]


def policy_to_pb(p: JobPolicy) -> pb.JobPolicy:
    fields: dict[str, Any] = {"keep_local": p.keep_local, "keep_persistent": p.keep_persistent,
                                 "persist_every": p.persist_every, "redundancy": p.redundancy}
    return pb.JobPolicy(**{k: v for k, v in fields.items() if v is not None})


def _tier_names(tiers) -> set[str]:
    out = set()
    for t in tiers:
        if t not in TIER_NAMES:
            raise InvalidArgumentError(f"tiers: {t} is not a tier")
        out.add(TIER_NAMES[t])
    return out or set(TIERS)


@dataclass
class Listening:
    servers: list[grpc.aio.Server]
    tcp_port: int | None
    socket_path: str | None
    claim: SocketClaim | None = None
    tenant_claims: list[SocketClaim] = field(default_factory=list)  # the tenant_sockets

    async def stop(self, grace: float) -> None:
        """Stop every server, then remove the Unix sockets that are still the ones this daemon bound."""
        try:
            await asyncio.gather(*(srv.stop(grace=grace) for srv in self.servers))
        finally:
            for c in [self.claim, *self.tenant_claims]:
                if c is not None:
                    c.release()


def server_options(config: DaemonConfig, *, tcp: bool = False) -> list[tuple[str, int]]:
    """gRPC server options. The mTLS TCP listener also bounds a connection's age, so that no
    connection outlives a CA or certificate change by more than the age plus its grace
    (:mod:`tierckptd.revocation`); the Unix socket keeps its connections (long waits)."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]
    if tcp and config.tls_enabled:
        options += [("grpc.max_connection_age_ms", int(KNOBS.max_connection_age * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(KNOBS.max_connection_age_grace * 1000))]
    return options


def _bind_reason(address: str) -> str | None:
    """Why ``address`` cannot be bound (learned by binding it as gRPC would), or None if it can."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            s.bind(addr)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_listen(address: str) -> None:
    """Refuse a ``listen`` address that cannot be bound now, before anything else starts.

    Raises:
        ConfigError: naming ``listen``, the address and the reason (e.g. "Address already in use").
    """
    if address.rpartition(":")[2] != "0" and (why := _bind_reason(address)) is not None:
        raise ConfigError(f"listen: cannot listen on {address}: {why}")


def _bind_error(address: str) -> ConfigError:
    return ConfigError(f"listen: cannot listen on {address}: {_bind_reason(address) or 'cannot bind'}")


async def create_server(config: DaemonConfig, node: Node, common: Callable[[grpc.aio.Server], None] | None = None,
                        server_credentials: grpc.ServerCredentials | None = None,
                        tcp_only: Callable[[grpc.aio.Server], None] | None = None, *,
                        tier_health: TierHealth | None = None, socket_claim: SocketClaim | None = None) -> Listening:
    """Build and start the gRPC servers on the configured listeners. Port 0 picks a free port.

    The Unix socket and the TCP listener are separate servers: both serve the Tierckpt service
    and ``common`` (health); only the TCP server (mTLS when configured) serves ``tcp_only``
    (the Peer service), so trainers in the socket group can never act as a peer. A live socket
    at the path is never taken over (:mod:`tierckptd.unixsock`); ``socket_claim`` is the claim
    when the caller made it already (before opening the local dir), and is released by
    :meth:`Listening.stop` either way.

    Raises:
        ConfigError: a listener cannot be bound, the socket path is in use, or ``socket_group``
            does not exist or cannot be given; the message names the key.
    """
    gid = resolve_group(config.socket_group) if config.socket else None  # before anything is bound
    servers: list[grpc.aio.Server] = []
    tcp_port = None
    if config.listen:
        access = ClientAccess(config.client_jobs_rules, config.max_open_saves_per_client)
        tcp = _new_server(config, node, common, tier_health, access)
        if tcp_only:
            tcp_only(tcp)
        try:
            if server_credentials is not None:
                tcp_port = tcp.add_secure_port(config.listen, server_credentials)
            else:
                tcp_port = tcp.add_insecure_port(config.listen)
        except RuntimeError:
            raise _bind_error(config.listen) from None
        servers.append(tcp)
    claim = None
    if config.socket:
        claim = socket_claim or claim_socket(os.path.abspath(config.socket))
        local = _new_server(config, node, common, tier_health, tenant=config.socket_tenant)
        try:
            local.add_insecure_port("unix://" + claim.bind_path)
        except RuntimeError:
            claim.release()
            raise ConfigError(f"socket: cannot listen on {claim.path}") from None
        servers.append(local)
    listening = Listening(servers, tcp_port, claim.path if claim else None, claim)
    tenants = [(t, resolve_group(t.group, f"tenant_sockets.{t.name}.group")) for t in config.tenant_socket_list]
    try:
        for t, _ in tenants:  # one server per tenant socket: its callers act as that tenant
            tclaim = claim_socket(os.path.abspath(t.path))
            listening.tenant_claims.append(tclaim)
            srv = _new_server(config, node, common, tier_health, tenant=t.name)
            try:
                srv.add_insecure_port("unix://" + tclaim.bind_path)
            except RuntimeError:
                raise ConfigError(f"tenant_sockets.{t.name}: cannot listen on {tclaim.path}") from None
            servers.append(srv)
        for srv in servers:
            await srv.start()
        if claim is not None:
            claim.bound(config.socket_mode, gid)
        for (t, tgid), tclaim in zip(tenants, listening.tenant_claims):
            tclaim.bound(t.mode, tgid)
    except BaseException:
        await listening.stop(0)
        raise
    return listening


def _new_server(config: DaemonConfig, node: Node, common: Callable[[grpc.aio.Server], None] | None,
                tier_health: TierHealth | None = None, access: ClientAccess | None = None,
                tenant: str = "") -> grpc.aio.Server:
    server = grpc.aio.server(options=server_options(config, tcp=access is not None))
    add_service(pb_grpc.add_TierckptServicer_to_server, TierckptServicer(node, config, tier_health, access, tenant),
                server)
    if common:
        common(server)
    return server
