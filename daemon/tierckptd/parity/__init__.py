"""XOR parity across placement groups (``redundancy = "parity:K+1"``): the peer tier's
alternative to full replicas. See :mod:`.layout` for the rules, :mod:`.slots` (the parity held
here), :mod:`.encoder` (protecting own ranks), :mod:`.rebuild` (reconstructing a lost rank) and
:mod:`.facade` (what the peer tier calls)."""

from .facade import Parity

__all__ = ["Parity"]
