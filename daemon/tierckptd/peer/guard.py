"""Who may do what on the Peer service and the bulk port (the trust model's peer rules).

- Identity: with mTLS, a peer's claimed node id (``sender``, ``requester``, ``node_id``) must be
  named by its certificate (CN or DNS SAN; :func:`tierckptd.tls.check_peer_node`). Without TLS
  (loopback, or ``insecure_listen``) the claim is believed: the network is the boundary.
- Replicas: a peer may push a copy only for an owner whose placement includes this node (R + 1
  live nodes after the owner on the ring, as this node sees them: the extra one covers the lost-
  owner re-replication), and never one that names this node as the owner.
- Drops: ``DropReplicas`` is honoured only from the owner itself, or for an owner that this node
  has seen down for the owner grace period.
"""

from __future__ import annotations

from typing import Any

from tierckpt.errors import PermissionDeniedError

from ..cluster import ring
from ..cluster.membership import Membership
from ..config import DaemonConfig
from ..knobs import KNOBS
from ..local.manifest import Manifest

__all__ = ["PeerGuard"]


class PeerGuard:
    def __init__(self, config: DaemonConfig, cluster: Membership, replicas: int) -> None:
        self.config, self.cluster, self.replicas = config, cluster, replicas
        self.node_id = config.node_id

    def identity(self, context: Any) -> set[str]:
        if not self.config.tls_enabled:
            return set()
        from .. import tls

        return tls.peer_identity(context)

    def check_claim(self, identity: set[str], claimed: str, field: str) -> None:
        """Raise PermissionDeniedError if mTLS is on and the certificate does not name ``claimed``."""
        if not self.config.tls_enabled:
            return
        from .. import tls

        msg = tls.check_peer_node(identity, claimed, self.config)
        if msg is not None:
            raise PermissionDeniedError(f"{field}: {msg}")

    def check_replica(self, man: Manifest) -> None:
        """A copy of ``man`` may be stored here (see the module docstring)."""
        if man.node == self.node_id:
            raise PermissionDeniedError(f"manifest_json.node: a peer may not push a copy naming this node "
                                        f"({self.node_id}) as its owner")
        if not self.in_placement(man.node):
            raise PermissionDeniedError(f"manifest_json.node: node {self.node_id} is not in the placement of "
                                        f"owner {man.node!r} (R={self.replicas})")

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

    def check_drop(self, identity: set[str], owner: str) -> None:
        """DropReplicas for ``owner``: from the owner itself, or for an owner gone for the grace period."""
        if not self.config.tls_enabled or not self.config.tls_bind_node_id or owner in identity:
            return
        if self.cluster.down_for(owner) >= KNOBS.owner_grace:
            return
        raise PermissionDeniedError(f"owner: only {owner!r} itself may drop its replicas while it is up "
                                    f"(the caller's certificate names {', '.join(sorted(identity)) or 'nothing'})")
