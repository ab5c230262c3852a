"""Parity across placement groups (``redundancy = "parity:K+M"``): the peer tier's alternative to
full replicas. XOR for M = 1: see :mod:`.layout` for the rules, :mod:`.slots` (the parity held
here), :mod:`.encoder` (protecting own ranks), :mod:`.rebuild` (reconstructing a lost rank).
Reed-Solomon for M >= 2: :mod:`.rs` (the code; :mod:`.gf` numpy, :mod:`.isal` ISA-L),
:mod:`.rslayout`, :mod:`.rsslots`, :mod:`.rsencoder`, :mod:`.rsprotector`, :mod:`.rsrebuild`.
:mod:`.facade` is what the peer tier calls."""

from .facade import Parity

__all__ = ["Parity"]
