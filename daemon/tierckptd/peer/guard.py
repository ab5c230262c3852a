"""Who may do what on the Peer service and the bulk port (the trust model's peer rules).

- Identity: every call names its caller's node id (``node_id``, ``sender`` or ``requester``:
  :meth:`PeerGuard.check_caller`). With mTLS the caller presents a node certificate (role URI
  ``tierckpt://node/<id>``) for that id (:func:`tierckptd.tls.check_node_role`), whose names are
  not on the deny-list; a client certificate is refused whatever it claims. The id must be a
  current cluster member (this node's ``--peers`` or discovered peers), except for ``Hello``,
  which discovery sends before it knows the caller. Without TLS (``insecure_listen``) the claim
  is believed: the network is the boundary.
- Replicas: a peer may push a copy only for an owner whose placement includes this node (R + 1
  live nodes after the owner on the ring, as this node sees them: the extra one covers the lost-
  owner re-replication), and never one that names this node as the owner. With node ids bound
  to certificates, only the owner itself pushes its ranks, or, once this node has seen the owner
  down for the owner grace, the first live holder of the rank after it on the ring (the one
  :mod:`.redundancy` lets re-replicate): a node cannot replace another's copies.
- Drops: ``DropReplicas`` is honoured only from the owner itself, or for an owner that this node
  has seen down for the owner grace period.
"""

from __future__ import annotations

from typing import Any

from tierckpt.errors import PermissionDeniedError

from .. import revocation, tls
from ..cluster import ring
from ..cluster.membership import Membership
from ..config import DaemonConfig
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..tls import Role

__all__ = ["PeerGuard"]


class PeerGuard:
    def __init__(self, config: DaemonConfig, cluster: Membership, replicas: int) -> None:
        self.config, self.cluster, self.replicas = config, cluster, replicas
        self.node_id = config.node_id

    def role(self, context: Any) -> Role | None:
        """The caller's certificate role (None without TLS)."""
        return tls.peer_role(context) if self.config.tls_enabled else None

    def check_caller(self, role: Role | None, claimed: str, field: str, *, member: bool = True) -> None:
        """Raise PermissionDeniedError unless the caller may act as node ``claimed`` (the module
        docstring): role, binding, deny-list and, with ``member``, cluster membership."""
        msg = tls.check_node_role(role, claimed, self.config)
        if msg is not None:
            raise PermissionDeniedError(f"{field}: {msg}")
        if role is not None:
            revocation.check_names(self.config, role.all_names)
        if member and claimed != self.node_id and claimed not in self.cluster.peers:
            raise PermissionDeniedError(f"{field}: node {claimed!r} is not a member of this node's cluster")

    def check_bulk(self, sslsock: Any) -> str:
        """A bulk connection's caller (TLS only): its node id, after :meth:`check_caller`."""
        role = tls.ssl_peer_role(sslsock)
        name = role.name if role is not None and role.kind == "node" else ""
        # tls_bind_node_id = false (one shared node certificate): the name is not a node id.
        self.check_caller(role, name, "certificate", member=self.config.tls_bind_node_id)
        return name

    def check_replica(self, man: Manifest, sender: str = "") -> None:
        """A copy of ``man`` from ``sender`` may be stored here (see the module docstring)."""
        if man.node == self.node_id:
            raise PermissionDeniedError(f"manifest_json.node: a peer may not push a copy naming this node "
                                        f"({self.node_id}) as its owner")
        if not self.in_placement(man.node):
            raise PermissionDeniedError(f"manifest_json.node: node {self.node_id} is not in the placement of "
                                        f"owner {man.node!r} (R={self.replicas})")
        if sender == man.node or not self.config.tls_enabled or not self.config.tls_bind_node_id:
            return
        if self.cluster.down_for(man.node) < KNOBS.owner_grace:
            raise PermissionDeniedError(f"sender: only {man.node!r} pushes copies of its ranks while it is up (or "
                                        f"down for less than the owner grace); the sender is {sender!r}")
        holders = [n for n in self.cluster.live_holders(man.key, man.generation) if n != self.node_id]
        first = ring.first_after(man.node, {sender, *holders})
        if first != sender:
            raise PermissionDeniedError(f"sender: {first!r}, not {sender!r}, is the first live holder after the lost "
                                        f"owner {man.node!r}; only it re-replicates the rank")

    def check_hint(self, sender: str) -> None:
        """A WarmReplica hint from ``sender``: only an owner whose placement includes this node."""
        if sender == self.node_id or not self.in_placement(sender):
            raise PermissionDeniedError(f"sender: node {self.node_id} is not in the placement of {sender!r} "
                                        f"(R={self.replicas})")

    def in_placement(self, owner: str) -> bool:
        """Whether this node is in ``owner``'s placement as it sees the cluster (:func:`ring.in_placement`)."""
        if owner not in self.cluster.peers:
            return False
        return ring.in_placement(self.node_id, owner, self.cluster.ids(), self.cluster.maybe_up(), self.replicas)

    def check_drop(self, caller: str, owner: str) -> None:
        """DropReplicas for ``owner``: from the owner itself, or for an owner gone for the grace period
        (``caller`` was checked by :meth:`check_caller`)."""
        if not self.config.tls_enabled or not self.config.tls_bind_node_id or owner == caller:
            return
        if self.cluster.down_for(owner) >= KNOBS.owner_grace:
            return
        raise PermissionDeniedError(f"owner: only {owner!r} itself may drop its replicas while it is up "
                                    f"(the caller is {caller!r})")
