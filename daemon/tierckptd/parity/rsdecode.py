"""Solving one stripe lane for a lost chunk (Reed-Solomon): blocking numpy/ISA-L work, no I/O.

Each row j of the lane is an equation ``row_j = sum over its members i of a[k+j, i] * d_i``
(a row that has not yet received a member simply lacks that term). The known data blocks are
subtracted (added: GF(2^8) has characteristic 2) from each usable row; the unknown blocks
(the target and any other member whose owner could not be read) are then the solution of a
square system whose matrix is a submatrix of the Cauchy rows, invertible whenever every row used
holds every unknown.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tierckpt.errors import UnavailableError

from .rs import Codec

__all__ = ["solve"]


def solve(codec: Codec, target: int, known: Mapping[int, bytes | bytearray | memoryview],
          unknown: list[int], rows: Mapping[int, tuple[bytearray, set[int]]], length: int) -> np.ndarray:
    """Data block ``target`` (``length`` bytes).

    Args:
        codec: The stripe's code (k data blocks).
        target: The data position wanted (in ``unknown``).
        known: Data position -> its bytes (at most the padded length; shorter means zero-padded).
        unknown: Data positions of the lane's members whose bytes could not be read.
        rows: Row -> (its bytes, the data positions it holds).
        length: The target chunk's true length.

    Raises:
        UnavailableError: fewer usable rows than unknowns, or the rows do not determine them.
    """
    usable = sorted(j for j, (_, held) in rows.items() if set(unknown) <= held)
    if len(usable) < len(unknown):
        raise UnavailableError(f"{len(unknown)} blocks of the stripe are lost (positions {sorted(unknown)}) and "
                               f"only {len(usable)} parity rows holding them could be read")
    usable = usable[:len(unknown)]
    width = max([len(rows[j][0]) for j in usable] + [len(b) for b in known.values()] + [length])
    residuals = []
    for j in usable:
        buf, held = rows[j]
        res = np.zeros(width, dtype=np.uint8)
        res[:len(buf)] = np.frombuffer(buf, dtype=np.uint8)
        for i in sorted(held & set(known)):
            codec.update([j], [res], i, known[i])
        residuals.append(res)
    coeffs = np.stack([[codec.matrix[codec.k + j, u] for u in unknown] for j in usable]).astype(np.uint8)
    try:
        inv = codec.impl.invert(coeffs)
    except ValueError:
        raise UnavailableError(f"the parity rows {usable} do not determine positions {sorted(unknown)}") from None
    out = np.zeros(width, dtype=np.uint8)
    codec.impl.dot(np.ascontiguousarray(inv[[unknown.index(target)]]), residuals, [out])
    return out[:length]
