"""The daemon-to-daemon Peer service: validate, delegate to the peer tier's parts, translate proto."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierckpt.common.names import MAX_SHARDS_PER_RANK, check_job, check_node, check_step
from tierckpt.errors import InvalidArgumentError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..offload import run_blocking
from ..rpc import Authorizing, rpc

if TYPE_CHECKING:
    from .tier import PeerTier

__all__ = ["PeerServicer"]


class PeerServicer(ppb_grpc.PeerServicer, Authorizing):
    """Thin servicer of the Peer service (served on the TCP listener only)."""

    def __init__(self, tier: PeerTier) -> None:
        self.tier = tier
        self.guard = tier.guard

    @rpc
    async def Hello(self, request: ppb.HelloRequest, context: Any) -> ppb.HelloResponse:
        return self.tier.hello()

    @rpc
    async def Catalog(self, request: ppb.CatalogRequest, context: Any) -> ppb.CatalogResponse:
        if request.node_id:
            self.guard.check_claim(self.guard.identity(context), request.node_id, "node_id")
            self.tier.cluster.heard_from(request.node_id)
        if request.job:
            check_job(request.job)
        return self.tier.local_catalog(request.job, request.since_version, request.since_instance)

    @rpc
    async def PrepareReplica(self, request: ppb.PrepareReplicaRequest, context: Any) -> ppb.PrepareReplicaResponse:
        if not request.manifest_json:
            raise InvalidArgumentError("manifest_json: required")
        check_node(request.sender, "sender")
        self.guard.check_claim(self.guard.identity(context), request.sender, "sender")
        return await self.tier.receiver.prepare(request.sender, request.manifest_json, self.guard.check_replica,
                                                link=request.skips_linked)

    @rpc
    async def CommitReplica(self, request: ppb.CommitReplicaRequest, context: Any) -> ppb.CommitReplicaResponse:
        if not request.ticket:
            raise InvalidArgumentError("ticket: required")
        ident = self.guard.identity(context)
        sender = self.tier.receiver.sender_of(request.ticket)
        if sender:
            self.guard.check_claim(ident, sender, "ticket")
        return ppb.CommitReplicaResponse(bytes=await self.tier.receiver.commit(request.ticket))

    @rpc
    async def AbortReplica(self, request: ppb.AbortReplicaRequest, context: Any) -> ppb.AbortReplicaResponse:
        await run_blocking(self.tier.receiver.abort, request.ticket)
        return ppb.AbortReplicaResponse()

    @rpc
    async def OpenRead(self, request: ppb.OpenReadRequest, context: Any) -> ppb.OpenReadResponse:
        check_job(request.job)
        check_step(request.step)
        check_node(request.requester, "requester")
        self.guard.check_claim(self.guard.identity(context), request.requester, "requester")
        return self.tier.receiver.open_read(request.job, request.step, request.rank, request.requester)

    @rpc
    async def DropReplicas(self, request: ppb.DropReplicasRequest, context: Any) -> ppb.DropReplicasResponse:
        check_job(request.job)
        check_node(request.owner, "owner")
        self.guard.check_drop(self.guard.identity(context), request.owner)
        removed = await self.tier.drop_replicas(request.owner, request.job, request.step, list(request.ranks),
                                                request.reason)
        return ppb.DropReplicasResponse(removed=removed)

    @rpc
    async def DeleteStepCopies(self, request: ppb.DeleteStepCopiesRequest,
                               context: Any) -> ppb.DeleteStepCopiesResponse:
        # Any certificate holder of the cluster may ask (SECURITY.md: peers are trusted alike);
        # the requester is checked against its certificate name.
        check_job(request.job)
        check_step(request.step)
        check_node(request.requester, "requester")
        self.guard.check_claim(self.guard.identity(context), request.requester, "requester")
        deleted = await self.tier.local.delete(request.job, request.step,
                                               reason=f"deleted on request of {request.requester}")
        return ppb.DeleteStepCopiesResponse(removed=deleted.copies)

    @rpc
    async def VerifyCopies(self, request: ppb.VerifyCopiesRequest, context: Any) -> ppb.VerifyCopiesResponse:
        check_job(request.job)
        if request.has_step:
            check_step(request.step)
        check_node(request.requester, "requester")
        self.guard.check_claim(self.guard.identity(context), request.requester, "requester")
        verified = await self.tier.local.verify(request.job, request.step if request.has_step else None)
        states = {"ok": 1, "mismatch": 2, "missing": 3}
        return ppb.VerifyCopiesResponse(copies=[ppb.VerifiedCopy(step=c.step, rank=c.rank, state=states[c.state],
                                                                 detail=c.detail) for c in verified.checks])

    @rpc
    async def WarmReplica(self, request: ppb.WarmReplicaRequest, context: Any) -> ppb.WarmReplicaResponse:
        check_node(request.sender, "sender")
        check_job(request.job)
        if len(request.sizes) > MAX_SHARDS_PER_RANK:
            raise InvalidArgumentError(f"sizes: at most {MAX_SHARDS_PER_RANK} shards per rank")
        self.guard.check_claim(self.guard.identity(context), request.sender, "sender")
        self.guard.check_hint(request.sender)
        accepted = await run_blocking(self.tier.store.warm.expect, request.job, request.rank, list(request.sizes))
        return ppb.WarmReplicaResponse(bytes=accepted)
