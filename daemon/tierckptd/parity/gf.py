"""GF(2^8) arithmetic for Reed-Solomon parity (``parity:K+M``, M >= 2), in numpy: the fallback
when ISA-L cannot be loaded (:mod:`.isal`), and the reference the ISA-L path is tested against.

The field is ISA-L's: polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11D), generator 2; the coding
matrix is ISA-L's ``gf_gen_cauchy1_matrix`` (K identity rows over M Cauchy rows
``1 / (i ^ j)``), so that both backends write the same parity bytes and a cluster may mix
nodes with and without ISA-L. Every K x K submatrix of a Cauchy-over-identity matrix is
invertible: any K of the K + M blocks recover the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["EXP", "LOG", "MUL", "gf_mul", "gf_inv", "cauchy_matrix", "invert", "matmul", "NumpyBackend",
           "MAX_BLOCKS"]

MAX_BLOCKS = 32
"""K + M at most (the configuration's bound; the field would allow 256)."""

_POLY = 0x11D
_BLOCK = 1 << 20  # bytes per numpy step: temporaries stay small and in cache


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= _POLY
    exp[255:510] = exp[0:255]
    a = np.arange(256)
    mul = exp[(log[a][:, None] + log[a][None, :]) % 255].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    return exp, log, mul


EXP, LOG, MUL = _tables()
"""Antilog (doubled, so a sum of two logs needs no reduction), log, and the full 256 x 256
product table (64 KiB): ``MUL[c]`` maps a byte array to ``c`` times it with one ``np.take``."""


def gf_mul(a: int, b: int) -> int:
    return int(MUL[a, b])


def gf_inv(a: int) -> int:
    """The inverse of ``a`` (0 for 0, as ISA-L's ``gf_inv``)."""
    return 0 if a == 0 else int(EXP[255 - LOG[a]])


def cauchy_matrix(k: int, m: int) -> np.ndarray:
    """The (K + M) x K coding matrix of ISA-L's ``gf_gen_cauchy1_matrix``: identity over Cauchy rows."""
    if not (1 <= k and 1 <= m and k + m <= MAX_BLOCKS):
        raise ValueError(f"k/m: need K >= 1, M >= 1 and K + M <= {MAX_BLOCKS} (got {k}+{m})")
    a = np.zeros((k + m, k), dtype=np.uint8)
    a[:k] = np.eye(k, dtype=np.uint8)
    for i in range(k, k + m):
        for j in range(k):
            a[i, j] = gf_inv(i ^ j)
    return a


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The GF(2^8) product of two small matrices."""
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            acc = 0
            for t in range(a.shape[1]):
                acc ^= int(MUL[a[i, t], b[t, j]])
            out[i, j] = acc
    return out


def invert(a: np.ndarray) -> np.ndarray:
    """The inverse of a square GF(2^8) matrix (Gauss-Jordan).

    Raises:
        ValueError: it is singular (never for K rows of a Cauchy-over-identity matrix).
    """
    n = a.shape[0]
    work = np.concatenate([a.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        pivot = next((r for r in range(col, n) if work[r, col]), None)
        if pivot is None:
            raise ValueError("matrix: singular, the blocks given cannot be decoded")
        if pivot != col:
            work[[col, pivot]] = work[[pivot, col]]
        work[col] = MUL[gf_inv(int(work[col, col]))][work[col]]
        for r in range(n):
            if r != col and work[r, col]:
                work[r] ^= MUL[int(work[r, col])][work[col]]
    return np.ascontiguousarray(work[:, n:])


class NumpyBackend:
    """Dot products of coefficient rows with byte blocks, one ``np.take`` per nonzero coefficient
    (numpy releases the GIL inside each). About an order of magnitude slower than ISA-L."""

    name = "numpy"

    @staticmethod
    def cauchy_matrix(k: int, m: int) -> np.ndarray:
        return cauchy_matrix(k, m)

    @staticmethod
    def invert(a: np.ndarray) -> np.ndarray:
        return invert(a)

    def dot(self, coeffs: np.ndarray, srcs: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        """``outs[r] = sum_j coeffs[r, j] * srcs[j]`` (all blocks of one length)."""
        for out in outs:
            out[:] = 0
        self.mad(coeffs, srcs, outs)

    def update(self, coeffs: np.ndarray, index: int, src: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """``outs[r] ^= coeffs[r, index] * src``: one data block's share added to parity rows."""
        self.mad(coeffs[:, index:index + 1], [src], outs)

    @staticmethod
    def mad(coeffs: np.ndarray, srcs: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        n = len(outs[0]) if outs else 0
        for off in range(0, n, _BLOCK):
            end = min(n, off + _BLOCK)
            for r, out in enumerate(outs):
                o = out[off:end]
                for j, src in enumerate(srcs):
                    c = int(coeffs[r, j])
                    if c == 1:
                        np.bitwise_xor(o, src[off:end], out=o)
                    elif c:
                        np.bitwise_xor(o, np.take(MUL[c], src[off:end]), out=o)
