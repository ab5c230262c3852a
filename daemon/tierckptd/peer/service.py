"""The daemon-to-daemon Peer service: validate, delegate to the peer tier's parts, translate proto."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierckpt.common.names import MAX_SHARDS_PER_RANK, check_job, check_node, check_owner, check_step
from tierckpt.errors import FailedPreconditionError, InvalidArgumentError, PermissionDeniedError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..offload import run_blocking
from ..rpc import Authorizing, rpc, rpc_stream

if TYPE_CHECKING:
    from .tier import PeerTier

__all__ = ["PeerServicer"]


_CALLER_FIELDS = ("node_id", "sender", "requester")


def caller_of(request: Any) -> tuple[str, str]:
    """(field, node id) of the caller a Peer request names (the id may be empty)."""
    fields = request.DESCRIPTOR.fields_by_name
    field = next(f for f in _CALLER_FIELDS if f in fields)
    return field, getattr(request, field)


class PeerServicer(ppb_grpc.PeerServicer, Authorizing):
    """Thin servicer of the Peer service (served on the TCP listener only).

    :meth:`authorize` runs before every method: the request names its caller, and the caller is
    a node certificate for that id and a cluster member (:meth:`PeerGuard.check_caller`)."""

    def __init__(self, tier: PeerTier) -> None:
        self.tier = tier
        self.guard = tier.guard

    def authorize(self, request: Any, context: Any) -> None:
        field, caller = caller_of(request)
        if not caller:
            raise PermissionDeniedError(f"{field}: every Peer call names its caller's node id")
        check_node(caller, field)
        self.guard.check_caller(self.guard.role(context), caller, field,
                                member=not isinstance(request, ppb.HelloRequest))

    def _check_ticket(self, ticket: str, caller: str) -> None:
        sender = self.tier.receiver.sender_of(ticket)
        if sender and sender != caller:
            raise PermissionDeniedError(f"ticket: issued to {sender!r}, not to the caller {caller!r}")

    @rpc
    async def Hello(self, request: ppb.HelloRequest, context: Any) -> ppb.HelloResponse:
        return self.tier.hello()

    @rpc
    async def Catalog(self, request: ppb.CatalogRequest, context: Any) -> ppb.CatalogResponse:
        self.tier.cluster.heard_from(request.node_id)
        if request.job:
            check_job(request.job)
        return self.tier.local_catalog(request.job, request.since_version, request.since_instance)

    @rpc
    async def PrepareReplica(self, request: ppb.PrepareReplicaRequest, context: Any) -> ppb.PrepareReplicaResponse:
        if not request.manifest_json:
            raise InvalidArgumentError("manifest_json: required")
        return await self.tier.receiver.prepare(
            request.sender, request.manifest_json, lambda man: self.guard.check_replica(man, request.sender),
            link=request.skips_linked)

    @rpc
    async def CommitReplica(self, request: ppb.CommitReplicaRequest, context: Any) -> ppb.CommitReplicaResponse:
        if not request.ticket:
            raise InvalidArgumentError("ticket: required")
        self._check_ticket(request.ticket, request.sender)
        return ppb.CommitReplicaResponse(bytes=await self.tier.receiver.commit(request.ticket))

    @rpc
    async def AbortReplica(self, request: ppb.AbortReplicaRequest, context: Any) -> ppb.AbortReplicaResponse:
        self._check_ticket(request.ticket, request.sender)
        await run_blocking(self.tier.receiver.abort, request.ticket)
        return ppb.AbortReplicaResponse()

    @rpc
    async def OpenRead(self, request: ppb.OpenReadRequest, context: Any) -> ppb.OpenReadResponse:
        check_job(request.job)
        check_step(request.step)
        return self.tier.receiver.open_read(request.job, request.step, request.rank, request.requester)

    @rpc
    async def DropReplicas(self, request: ppb.DropReplicasRequest, context: Any) -> ppb.DropReplicasResponse:
        check_job(request.job)
        check_node(request.owner, "owner")
        self.guard.check_drop(request.requester, request.owner)
        removed = await self.tier.drop_replicas(request.owner, request.job, request.step, list(request.ranks),
                                                request.reason)
        return ppb.DropReplicasResponse(removed=removed)

    @rpc
    async def DeleteStepCopies(self, request: ppb.DeleteStepCopiesRequest,
                               context: Any) -> ppb.DeleteStepCopiesResponse:
        # Any node of the cluster may ask (SECURITY.md: peers are trusted alike for data management).
        check_job(request.job)
        check_step(request.step)
        owner = check_owner(request.job_owner) if request.has_job_owner else None
        deleted = await self.tier.local.delete(request.job, request.step, owner,
                                               reason=f"deleted on request of {request.requester}")
        return ppb.DeleteStepCopiesResponse(removed=deleted.copies)

    @rpc
    async def VerifyCopies(self, request: ppb.VerifyCopiesRequest, context: Any) -> ppb.VerifyCopiesResponse:
        check_job(request.job)
        if request.has_step:
            check_step(request.step)
        verified = await self.tier.local.verify(request.job, request.step if request.has_step else None)
        states = {"ok": 1, "mismatch": 2, "missing": 3}
        return ppb.VerifyCopiesResponse(copies=[ppb.VerifiedCopy(step=c.step, rank=c.rank, state=states[c.state],
                                                                 detail=c.detail) for c in verified.checks])

    @rpc
    async def WarmReplica(self, request: ppb.WarmReplicaRequest, context: Any) -> ppb.WarmReplicaResponse:
        check_job(request.job)
        if len(request.sizes) > MAX_SHARDS_PER_RANK:
            raise InvalidArgumentError(f"sizes: at most {MAX_SHARDS_PER_RANK} shards per rank")
        self.guard.check_hint(request.sender)
        accepted = await run_blocking(self.tier.store.warm.expect, request.job, request.rank, list(request.sizes))
        return ppb.WarmReplicaResponse(bytes=accepted)

    # ------------------------------------------------------------------------------ parity

    def _parity(self) -> Any:
        """The node's parity codes (:class:`tierckptd.parity.shapes.ParityShapes`): each request
        is routed to the code it names (ProtectRank, ParityLookup) or to the one holding it."""
        parities = getattr(self.tier, "parities", None)
        if parities is None:
            raise FailedPreconditionError(f"redundancy: node {self.tier.node_id} does not use parity")
        return parities.held

    @rpc
    async def ProtectRank(self, request: ppb.ProtectRankRequest, context: Any) -> ppb.ProtectRankResponse:
        if not request.manifest_json:
            raise InvalidArgumentError("manifest_json: required")
        return await self._parity().protect(request)

    @rpc_stream
    async def ReadRankRange(self, request: ppb.ReadRankRangeRequest, context: Any):
        check_job(request.job)
        check_step(request.step)
        async for piece in self._parity().read_rank_range(request):
            yield piece

    @rpc_stream
    async def RebuildChunk(self, request: ppb.RebuildChunkRequest, context: Any):
        check_job(request.job)
        check_step(request.step)
        check_node(request.owner, "owner")
        async for piece in self._parity().rebuild_chunk(request):
            yield piece

    @rpc
    async def OpenSlotRead(self, request: ppb.RebuildChunkRequest, context: Any) -> ppb.OpenSlotReadResponse:
        check_job(request.job)
        check_step(request.step)
        check_node(request.owner, "owner")
        return await self._parity().open_slot_read(request, self.tier.receiver)

    @rpc
    async def OpenRebuiltChunk(self, request: ppb.RebuildChunkRequest, context: Any) -> ppb.OpenSlotReadResponse:
        check_job(request.job)
        check_step(request.step)
        check_node(request.owner, "owner")
        return await self._parity().open_rebuilt_chunk(request)

    @rpc
    async def OpenRowRead(self, request: ppb.ReadParityRowRequest, context: Any) -> ppb.OpenSlotReadResponse:
        check_job(request.job)
        check_step(request.step)
        return await self._parity().open_row_read(request)

    @rpc
    async def ParityLookup(self, request: ppb.ParityLookupRequest, context: Any) -> ppb.ParityLookupResponse:
        check_job(request.job)
        parities = getattr(self.tier, "parities", None)
        if parities is None:
            return ppb.ParityLookupResponse()
        return parities.held.lookup(request)

    @rpc_stream
    async def ReadParityRow(self, request: ppb.ReadParityRowRequest, context: Any):
        check_job(request.job)
        check_step(request.step)
        async for piece in self._parity().read_row(request):
            yield piece

    @rpc
    async def DropParity(self, request: ppb.DropParityRequest, context: Any) -> ppb.DropParityResponse:
        check_job(request.job)
        check_step(request.step)
        return ppb.DropParityResponse(removed=await self._parity().shapes.drop_local(request.job, request.step))
