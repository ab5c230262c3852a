"""The peer tier: replicas of every committed rank on R other daemons (see :mod:`.tier`)."""

from .tier import PeerTier
from .transfer import plan_pieces

__all__ = ["PeerTier", "plan_pieces"]
