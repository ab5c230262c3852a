"""Reed-Solomon over GF(2^8) for ``parity:K+M``: K data blocks, M parity rows, any K of the
K + M blocks recover the rest.

Blocks are numbered 0..K-1 (data) and K..K+M-1 (parity row ``r`` is block ``K + r``). Every
block of a stripe has one length (shorter data is zero-padded by the caller, which keeps the
true lengths: a zero block adds nothing to a parity row). A parity row is linear in the data, so
a holder builds its row one data block at a time as the owners commit (:meth:`Codec.update`),
in any order, without ever holding the others.

Backend: ISA-L (:mod:`.isal`) when loadable, else numpy (:class:`.gf.NumpyBackend`); both write
identical bytes (tests/test_rs.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import gf, isal

__all__ = ["Codec", "backend"]


@functools.cache
def backend() -> Any:
    """The process's backend: ISA-L if loadable, else numpy (decided once)."""
    return isal.load() or gf.NumpyBackend()


def _u8(buf: Any) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 else np.frombuffer(buf, dtype=np.uint8)


class Codec:
    """The K + M code (immutable; safe to share between threads).

    Args:
        k: Data blocks (>= 1).
        m: Parity rows (>= 1); K + M <= :data:`.gf.MAX_BLOCKS`.
        impl: A backend (tests pass one); default :func:`backend`.
    """

    def __init__(self, k: int, m: int, impl: Any = None) -> None:
        self.k, self.m = k, m
        self.impl = impl if impl is not None else backend()
        self.matrix = gf.cauchy_matrix(k, m)  # validates k, m
        self.matrix.setflags(write=False)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.m:
            raise ValueError(f"row: parity row {row} is not in 0..{self.m - 1}")

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.k:
            raise ValueError(f"index: data block {index} is not in 0..{self.k - 1}")

    def encode(self, data: Sequence[Any]) -> list[np.ndarray]:
        """The M parity rows of K equal-length data blocks."""
        if len(data) != self.k:
            raise ValueError(f"data: {len(data)} blocks given, the code has K = {self.k}")
        srcs = [_u8(d) for d in data]
        n = _one_length(srcs, "data")
        outs = [np.zeros(n, dtype=np.uint8) for _ in range(self.m)]
        if n:
            self.impl.dot(self.matrix[self.k:], srcs, outs)
        return outs

    def update(self, rows: Sequence[int], parity: Sequence[Any], index: int, block: Any) -> None:
        """Add data block ``index``'s share to parity ``rows`` in place (``parity[i]`` holds row
        ``rows[i]``, writable, at least as long as ``block``)."""
        self._check_index(index)
        for r in rows:
            self._check_row(r)
        src = _u8(block)
        if not len(src) or not rows:
            return
        outs = [np.frombuffer(p, dtype=np.uint8, count=len(src)) if not isinstance(p, np.ndarray) else p[:len(src)]
                for p in parity]
        coeffs = np.ascontiguousarray(self.matrix[[self.k + r for r in rows]])
        self.impl.update(coeffs, index, src, outs)

    def decode(self, present: Mapping[int, Any], want: Sequence[int]) -> dict[int, np.ndarray]:
        """Blocks ``want`` (data or parity numbers) from at least K ``present`` ones.

        Raises:
            ValueError: fewer than K blocks, a block number out of range, or unequal lengths.
        """
        n_blocks = self.k + self.m
        for i in [*present, *want]:
            if not 0 <= i < n_blocks:
                raise ValueError(f"block: {i} is not in 0..{n_blocks - 1}")
        if len(present) < self.k:
            raise ValueError(f"present: {len(present)} blocks given, decoding needs K = {self.k}")
        use = sorted(present)[:self.k]
        srcs = [_u8(present[i]) for i in use]
        n = _one_length(srcs, "present")
        inv = self.impl.invert(self.matrix[use])
        out: dict[int, np.ndarray] = {}
        todo = [w for w in dict.fromkeys(want)]
        for w in todo:
            if w in present:
                out[w] = _u8(present[w]).copy()
        rest = [w for w in todo if w not in out]
        if not rest:
            return out
        coeffs = np.ascontiguousarray(np.stack([inv[w] if w < self.k else gf.matmul(self.matrix[w:w + 1], inv)[0]
                                                for w in rest]))
        outs = [np.zeros(n, dtype=np.uint8) for _ in rest]
        if n:
            self.impl.dot(coeffs, srcs, outs)
        out.update(zip(rest, outs))
        return out


def _one_length(blocks: Sequence[np.ndarray], what: str) -> int:
    lengths = {len(b) for b in blocks}
    if len(lengths) > 1:
        raise ValueError(f"{what}: blocks of one stripe must have one length (got {sorted(lengths)})")
    return lengths.pop() if lengths else 0
