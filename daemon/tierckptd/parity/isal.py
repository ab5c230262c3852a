"""ISA-L's erasure-code kernels through ctypes (AVX2/AVX-512/GFNI, picked by ISA-L at run time).

The shared library is the one bundled in the ``pyeclib`` wheel (``pyeclib.libs/libisal*.so*``;
the ``daemon`` extra installs it), found with :func:`importlib.util.find_spec` without importing
pyeclib (which would load liberasurecode for nothing), else a system ``libisal``. ctypes releases
the GIL for the length of each call, so encoding on the offload threads runs in parallel with
the event loop. :func:`load` returns None when neither is there (or ``TIERCKPT_NO_ISAL=1``): the
codec then uses :class:`.gf.NumpyBackend`, which writes the same bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["IsalBackend", "load", "library_path"]

log = logging.getLogger(__name__)

_U8P = ctypes.POINTER(ctypes.c_ubyte)
_PIECE = 1 << 30  # ISA-L's lengths are C ints


def library_path() -> str | None:
    """The path of a loadable ISA-L: pyeclib's bundled copy first, else the system's."""
    spec = importlib.util.find_spec("pyeclib")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        libs = Path(loc).parent / "pyeclib.libs"
        found = sorted(libs.glob("libisal*.so*")) if libs.is_dir() else []
        if found:
            return str(found[0])
    return ctypes.util.find_library("isal")


class IsalBackend:
    """:class:`.gf.NumpyBackend`'s interface over ``ec_init_tables`` / ``ec_encode_data`` /
    ``ec_encode_data_update``; the expanded tables (32 bytes per coefficient) are cached per
    coefficient matrix."""

    name = "isal"

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, _U8P, _U8P]
        lib.ec_init_tables.restype = None
        lib.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, _U8P, ctypes.POINTER(_U8P),
                                       ctypes.POINTER(_U8P)]
        lib.ec_encode_data.restype = None
        lib.ec_encode_data_update.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, _U8P, _U8P,
                                              ctypes.POINTER(_U8P)]
        lib.ec_encode_data_update.restype = None
        lib.gf_gen_cauchy1_matrix.argtypes = [_U8P, ctypes.c_int, ctypes.c_int]
        lib.gf_gen_cauchy1_matrix.restype = None
        lib.gf_invert_matrix.argtypes = [_U8P, _U8P, ctypes.c_int]
        lib.gf_invert_matrix.restype = ctypes.c_int
        self.lib, self.path = lib, path
        self._tables: dict[tuple[bytes, tuple[int, int]], np.ndarray] = {}

    # ------------------------------------------------------------------------------ matrices

    def cauchy_matrix(self, k: int, m: int) -> np.ndarray:
        a = np.zeros((k + m, k), dtype=np.uint8)
        self.lib.gf_gen_cauchy1_matrix(_ptr(a), k + m, k)
        return a

    def invert(self, a: np.ndarray) -> np.ndarray:
        n = a.shape[0]
        work = np.ascontiguousarray(a, dtype=np.uint8).copy()  # ISA-L overwrites its input
        out = np.zeros((n, n), dtype=np.uint8)
        if self.lib.gf_invert_matrix(_ptr(work), _ptr(out), n) != 0:
            raise ValueError("matrix: singular, the blocks given cannot be decoded")
        return out

    # ------------------------------------------------------------------------------ blocks

    def _gftbls(self, coeffs: np.ndarray) -> np.ndarray:
        c = np.ascontiguousarray(coeffs, dtype=np.uint8)
        key = (c.tobytes(), c.shape)
        t = self._tables.get(key)
        if t is None:
            rows, k = c.shape
            t = np.zeros(32 * k * rows, dtype=np.uint8)
            self.lib.ec_init_tables(k, rows, _ptr(c), _ptr(t))
            if len(self._tables) > 256:
                self._tables.clear()
            self._tables[key] = t
        return t

    def dot(self, coeffs: np.ndarray, srcs: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        rows, k = coeffs.shape
        t = self._gftbls(coeffs)
        n = len(outs[0]) if outs else 0
        for off in range(0, n, _PIECE):
            ln = min(_PIECE, n - off)
            self.lib.ec_encode_data(ln, k, rows, _ptr(t), _ptrs(srcs, off), _ptrs(outs, off))

    def update(self, coeffs: np.ndarray, index: int, src: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        rows, k = coeffs.shape
        t = self._gftbls(coeffs)
        n = len(src)
        for off in range(0, n, _PIECE):
            ln = min(_PIECE, n - off)
            self.lib.ec_encode_data_update(ln, k, rows, index, _ptr(t), _ptr(src, off), _ptrs(outs, off))


def _ptr(a: np.ndarray, off: int = 0) -> ctypes._Pointer:
    return ctypes.cast(a.ctypes.data + off, _U8P)


def _ptrs(arrays: Sequence[np.ndarray], off: int) -> ctypes.Array:
    return (_U8P * len(arrays))(*(_ptr(a, off) for a in arrays))


def load(environ: Mapping[str, str] | None = None) -> IsalBackend | None:
    """ISA-L, or None (not installed, not loadable, or ``TIERCKPT_NO_ISAL=1`` in ``environ``,
    default ``os.environ``: the one environment read of the codec, a switch for tests and
    benchmarks)."""
    env = os.environ if environ is None else environ
    if env.get("TIERCKPT_NO_ISAL", "") not in ("", "0"):
        return None
    path = library_path()
    if path is None:
        return None
    try:
        return IsalBackend(path)
    except (OSError, AttributeError) as e:  # not loadable here, or a build without these symbols
        log.warning("ISA-L at %s not usable (%s): Reed-Solomon parity uses numpy", path, e)
        return None
