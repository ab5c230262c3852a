"""libblosc2's zstd: planes decoded into buffers the caller owns, and frames of literals alone.

Issue 28 item 2 asks the torch-free float codec (:mod:`.compress`'s ``bp*``) to decode at least as
fast as ZipNN. Where a ``bp*`` decode went (bench/README.md "Issue 28, item 2"): zstd's decode of
the exponent plane, most of it its Huffman decode of literals, the rest the few matches that
zstd's match finder still found (hundreds per block on Adam's exp_avg_sq, which made its decode
3x slower than the literals alone), the copy of the literals into place and python-zstandard's
new output object; then the merge of the planes. The libblosc2 shared library that
:mod:`.byteshuffle` already loads exports zstd 1.5's API, its Huffman coder included (the same
zstd the ``zstandard`` wheel bundles). Through ctypes (the GIL released during each call):

- :func:`literal_frame` codes a plane as a zstd frame whose 128 KiB blocks are Huffman-coded
  literals and no sequences (ZipNN's code of the exponent plane, in zstd's frame format: any zstd
  decoder reads it, so older daemons and the fallback below read new chunks);
- :func:`literal_blocks` / :func:`put_block` decode such a frame block by block straight into
  the caller's memory (no sequence pass, no copy: :func:`.byteshuffle.merge_blocks` decodes each
  block into its merge scratch);
- :func:`decompress_into` decodes any other zstd frame of a plane with zstd's one-shot decoder
  into a buffer the caller keeps (no new object whose pages are faulted in per chunk).

Stored bytes are hostile (issue 27): a frame must announce exactly the size it is read as and end
exactly where the plane ends (no second frame, no trailing bytes: python-zstandard's
``allow_extra_data=False``); every block length is checked against the frame and the plane before
anything is written; zstd's decoders never write past the capacity they are given (the one-shot
decoder needs no window buffer, so a frame's window size allocates nothing). Any error is a
:class:`ValueError` the codec reports as data loss (tests/persistent/test_zstdlib.py).

The Huffman functions are zstd's internal API, whose arguments changed in 1.5.5: they are used
only with zstd 1.5.5 - 1.5.x and after a probe (a frame coded here read back by python-zstandard);
elsewhere :func:`huffman` is False and planes are coded by python-zstandard as before. Where
libblosc2 is missing or fails its probe, :func:`available` is False and python-zstandard decodes;
:func:`use_native` switches libblosc2 off for tests.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from . import byteshuffle

__all__ = ["available", "huffman", "decompress_into", "literal_frame", "literal_blocks", "put_block", "use_native",
           "address"]

_UNKNOWN = (1 << 64) - 1  # ZSTD_CONTENTSIZE_UNKNOWN; ZSTD_CONTENTSIZE_ERROR is one less
_lock = threading.Lock()
_state: dict[str, Any] = {}
_local = threading.local()


class _DCtx:
    """One thread's zstd decompression context, freed with the thread's locals."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.ptr = lib.ZSTD_createDCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createDCtx failed")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeDCtx(self.ptr)
            self.ptr = None


def _load() -> Any:
    """libblosc2's zstd functions with their C signatures, or None (missing, or fails a probe)."""
    path = byteshuffle._find()
    if path is None:
        return None
    try:
        lib: Any = ctypes.CDLL(str(path))
        size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
        for name, restype, argtypes in (
                ("ZSTD_createDCtx", ptr, []), ("ZSTD_freeDCtx", size_t, [ptr]),
                ("ZSTD_decompressDCtx", size_t, [ptr, ptr, size_t, ptr, size_t]),
                ("ZSTD_getFrameContentSize", ctypes.c_ulonglong, [ptr, size_t]),
                ("ZSTD_findFrameCompressedSize", size_t, [ptr, size_t]),
                ("ZSTD_isError", ctypes.c_uint, [size_t]), ("ZSTD_getErrorName", ctypes.c_char_p, [size_t]),
                ("ZSTD_versionNumber", ctypes.c_uint, [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        if lib.ZSTD_versionNumber() < 10400:  # 1.4: the one-shot API and its bounds as used here
            return None
        lib.huf = _huf(lib)
        import zstandard

        probe = bytes(range(256)) * 40
        frame = zstandard.ZstdCompressor(level=1).compress(probe)
        out = ctypes.create_string_buffer(len(probe))
        if _decode(lib, frame, ctypes.addressof(out), len(probe)) != len(probe) or out.raw != probe:
            return None
        if lib.huf:  # frames of literals alone: read alike by python-zstandard and by the fast path
            plane = bytes((i * i) % 13 for i in range(4096)) * 70 + bytes(300) + bytes(range(256)) * 2
            lit = _literal_frame(lib, plane)
            back = ctypes.create_string_buffer(len(plane))
            lib.huf = (lit is not None and zstandard.ZstdDecompressor().decompress(lit) == plane
                       and _decode(lib, lit, ctypes.addressof(back), len(plane)) == len(plane) and back.raw == plane)
    except (OSError, AttributeError, ImportError, ValueError):
        return None
    return lib


def _huf(lib: Any) -> bool:
    """Give ``lib`` zstd's Huffman coder with its C signatures, where they are known: they are
    zstd's internal API (exported by libblosc2), whose arguments changed in 1.5.5, so only
    1.5.5 - 1.5.x; elsewhere (False) planes are coded by zstd's frame API alone."""
    if not 10505 <= lib.ZSTD_versionNumber() < 10600:
        return False
    size_t, ptr, flags = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    try:
        for name, restype, argtypes in (
                ("HUF_compress4X_repeat", size_t, [ptr, size_t, ptr, size_t, ctypes.c_uint, ctypes.c_uint, ptr,
                                                   size_t, ptr, ptr, flags]),
                ("HUF_decompress4X_hufOnly_wksp", size_t, [ptr, ptr, size_t, ptr, size_t, ptr, size_t, flags]),
                ("HUF_decompress4X_usingDTable", size_t, [ptr, size_t, ptr, size_t, ptr, flags]),
                ("HUF_isError", ctypes.c_uint, [size_t])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except AttributeError:
        return False
    return True


def _native() -> Any:
    if _state.get("off"):
        return None
    if "ready" not in _state:
        with _lock:
            if "ready" not in _state:
                lib = _load()
                _state["lib"], _state["ready"] = lib, True
    return _state["lib"]


def available() -> bool:
    """Whether :func:`decompress_into` can run (libblosc2 loaded, not switched off)."""
    return _native() is not None


def huffman() -> bool:
    """Whether :func:`literal_frame` codes (libblosc2's zstd is 1.5.5 - 1.5.x and passed its probe)."""
    lib = _native()
    return lib is not None and bool(lib.huf)


def use_native(enabled: bool) -> None:
    """Decode zstd planes through libblosc2 (the default) or through python-zstandard (``False``)."""
    _state["off"] = not enabled


def address(buffer: Any) -> tuple[int, int]:
    """The address and length of any contiguous buffer (read-only ones too: ``bytes``, a slice of it)."""
    import numpy as np

    arr = np.frombuffer(buffer, np.uint8)
    return arr.ctypes.data, len(arr)


def _decode(lib: Any, frame: Any, dst: int, size: int) -> int:
    src, length = address(frame)
    if length == 0:
        raise ValueError("empty zstd frame")
    announced = lib.ZSTD_getFrameContentSize(src, length)
    if announced >= _UNKNOWN - 1 or announced != size:
        raise ValueError(f"zstd frame announces {announced if announced < _UNKNOWN - 1 else 'no'} size, "
                         f"expected {size}")
    end = lib.ZSTD_findFrameCompressedSize(src, length)
    if lib.ZSTD_isError(end) or end != length:
        raise ValueError("zstd frame is cut short or followed by other bytes")
    if lib.huf and _literal_blocks(lib, frame, src, length, dst, size):
        return size
    dctx = getattr(_local, "dctx", None)
    if dctx is None or dctx.lib is not lib:
        dctx = _local.dctx = _DCtx(lib)
    got = lib.ZSTD_decompressDCtx(dctx.ptr, dst, size, src, length)
    if lib.ZSTD_isError(got):
        raise ValueError(f"zstd: {lib.ZSTD_getErrorName(got).decode(errors='replace')}")
    if got != size:
        raise ValueError(f"zstd frame decodes to {got} bytes, expected {size}")
    return int(got)


def decompress_into(frame: Any, dst: int, size: int) -> None:
    """Decode one zstd frame of exactly ``size`` plain bytes into the ``size`` writable bytes at
    address ``dst`` (the caller keeps that buffer alive and at least ``size`` long).

    Raises:
        ValueError: the library is not available, or ``frame`` is not one whole frame of ``size`` bytes.
    """
    lib = _native()
    if lib is None:
        raise ValueError("libblosc2's zstd is not available")
    _decode(lib, frame, dst, size)


_BLOCK = 1 << 17  # zstd's largest block, and the most HUF_compress4X takes at once
_HEADER = b"\x28\xb5\x2f\xfd\xe0"  # magic; single segment with an 8-byte content size, no checksum
_MIN_CODED = 256  # a block shorter than this is stored raw (zstd's own bound for 4 Huffman streams)
_TABLELOG = 11  # the most bits of a Huffman code (zstd's HUF_TABLELOG_DEFAULT)


def _bmi2() -> int:
    """zstd's ``HUF_flags_bmi2`` where the CPU has BMI2 (what zstd's own contexts pass), else 0."""
    try:
        with open("/proc/cpuinfo") as f:
            return 1 if " bmi2" in f.read(1 << 16) else 0
    except OSError:
        return 0


class _Work:
    """One thread's Huffman tables and workspaces (zstd keeps the same inside its contexts)."""

    def __init__(self) -> None:
        self.ctable = ctypes.create_string_buffer(4096)  # HUF_CElt[257]: 2056 bytes
        self.cwork = ctypes.create_string_buffer(1 << 14)  # HUF_WORKSPACE_SIZE: 8704 bytes
        self.out = ctypes.create_string_buffer(_BLOCK + 4096)
        self.repeat = ctypes.c_int(0)
        self.dtable = (ctypes.c_uint32 * (2 * 4096 + 1))()
        self.dtable[0] = 12 * 0x01000001  # HUF_TABLELOG_MAX, as zstd's contexts declare theirs
        self.dwork = ctypes.create_string_buffer(1 << 16)  # HUF_DECOMPRESS_WORKSPACE_SIZE: 2560 bytes
        self.flags = _state.setdefault("bmi2", _bmi2())


def _work() -> _Work:
    held = getattr(_local, "work", None)
    if held is None:
        held = _local.work = _Work()
    return held


def _block(last: int, kind: int, size: int) -> bytes:
    return (last | kind << 1 | size << 3).to_bytes(3, "little")


def literal_frame(plane: Any) -> bytes | None:
    """A zstd frame of ``plane`` with no matches at all: each 128 KiB block is its literals,
    Huffman-coded (4 streams, a table of its own), and no sequences; a block that does not shrink
    is stored raw, one of one byte value as RLE. That is ZipNN's code of the exponent plane (a
    table per 256 KiB), in zstd's frame format: any zstd decoder reads it, and :func:`decompress_into`
    decodes each block's literals straight into place (no sequence pass, no copy of the literals).
    None where libblosc2's Huffman coder is not available (then the caller uses zstd's frame API)."""
    lib = _native()
    if lib is None or not lib.huf:
        return None
    return _literal_frame(lib, plane)


def _literal_frame(lib: Any, plane: Any) -> bytes | None:
    src, size = address(plane)
    work = _work()
    parts, held = [_HEADER, size.to_bytes(8, "little")], False
    starts = range(0, size, _BLOCK) if size else [0]
    for start in starts:
        n, last = min(_BLOCK, size - start), int(start + _BLOCK >= size)
        got, reused = 0, held
        if n >= _MIN_CODED:
            # HUF_repeat_check where the decoder holds a table: zstd's coder reuses it when that
            # is no bigger (it leaves ``repeat`` set), else writes a new one (``repeat`` none)
            work.repeat.value = int(held)
            got = lib.HUF_compress4X_repeat(work.out, len(work.out), src + start, n, 255, _TABLELOG, work.cwork,
                                            len(work.cwork), work.ctable, ctypes.byref(work.repeat), work.flags)
            if lib.HUF_isError(got):
                return None
            reused = held and work.repeat.value != 0
        if got == 1:  # one byte value throughout
            parts += [_block(last, 1, n), bytes(plane[start:start + 1])]
        elif got == 0 or got + 6 >= n:
            parts += [_block(last, 0, n), bytes(plane[start:start + n])]
        else:  # literals section: compressed (2) or with the last table (3, "treeless"), 4 streams,
            # 18-bit sizes (5 bytes); then 0 sequences
            head = ((3 if reused else 2) | 3 << 2 | n << 4 | got << 22).to_bytes(5, "little")
            parts += [_block(last, 2, got + 6), head, ctypes.string_at(work.out, got), b"\x00"]
        # the decoder's table: unchanged when reused, else the one just written, if it was
        held = reused or (got > 1 and got + 6 < n)
    return b"".join(parts)


Block = tuple[int, int, int, int]
"""One block of a :func:`literal_frame`: (kind: 0 raw, 1 RLE, 2 Huffman-coded literals with their
table, 3 with the last block's table; address of its bytes in the frame; their length; the plain
bytes it makes)."""


def _parse(frame: Any, src: int, length: int, size: int) -> list[Block] | None:
    """The blocks of a frame of :func:`literal_frame`'s shape making ``size`` bytes, every length
    checked against the frame and ``size``; None when the frame has another shape (zstd's frame
    decoder reads it). Raises ValueError where the frame is malformed."""
    if length < 16 or bytes(frame[:5]) != _HEADER:
        return None
    announced = int.from_bytes(frame[5:13], "little")
    if announced != size:
        raise ValueError(f"zstd frame announces {announced} bytes, expected {size}")
    pos, off, last, blocks, table = 13, 0, 0, [], False
    while not last:
        if pos + 3 > length:
            raise ValueError("zstd frame cut short")
        head = int.from_bytes(frame[pos:pos + 3], "little")
        last, kind, bsize = head & 1, head >> 1 & 3, head >> 3
        pos += 3
        n, body = bsize, bsize
        if kind == 2:
            if bsize < 7 or pos + bsize > length or frame[pos] & 14 != 14 or frame[pos + bsize - 1] != 0:
                return None  # not Huffman-coded literals alone
            lit = int.from_bytes(frame[pos:pos + 5], "little")
            n, body, kind = lit >> 4 & 0x3FFFF, lit >> 22, 2 + (lit & 1)
            if body + 6 != bsize:
                return None
            if kind == 3 and not table:
                raise ValueError("zstd literals reuse a Huffman table before any")
            table = True
            blocks.append((kind, src + pos + 5, body, n))
        elif kind < 2:
            body = 1 if kind == 1 else bsize
            if pos + body > length:
                raise ValueError("zstd block past the end of its frame")
            blocks.append((kind, src + pos, body, n))
        else:
            raise ValueError("reserved zstd block type")
        if n > _BLOCK or n > size - off:
            raise ValueError("zstd block longer than 128 KiB or than the plane")
        off += n
        pos += bsize if kind != 1 else 1
    if pos != length or off != size:
        raise ValueError(f"zstd frame of {off} bytes and {length - pos} after it, expected {size} and none")
    return blocks


def literal_blocks(frame: Any, size: int) -> list[Block] | None:
    """The blocks of ``frame`` (a zstd frame of ``size`` plain bytes) when it has
    :func:`literal_frame`'s shape and the Huffman decoder is available, for :func:`put_block`
    (the caller keeps ``frame`` alive meanwhile); else None (use :func:`decompress_into`).

    Raises:
        ValueError: the frame is malformed (its lengths do not add up).
    """
    lib = _native()
    if lib is None or not lib.huf:
        return None
    src, length = address(frame)
    return _parse(frame, src, length, size)


def put_block(block: Block, dst: int) -> None:
    """Write the plain bytes of one block of :func:`literal_blocks` at address ``dst`` (``block[3]``
    writable bytes there; the Huffman decoder writes no more than that whatever the bytes).

    Raises:
        ValueError: the block's coded bytes are corrupt.
    """
    _put(_state["lib"], block, dst)


def _put(lib: Any, block: Block, dst: int) -> None:
    kind, src, length, n = block
    if kind == 0:
        ctypes.memmove(dst, src, n)
    elif kind == 1:
        ctypes.memset(dst, ctypes.c_uint8.from_address(src).value, n)
    elif kind == 2:
        work = _work()
        got = lib.HUF_decompress4X_hufOnly_wksp(work.dtable, dst, n, src, length, work.dwork, len(work.dwork),
                                                work.flags)
    else:  # the table of the last kind-2 block (:func:`_parse` puts one first; blocks are decoded in order)
        work = _work()
        got = lib.HUF_decompress4X_usingDTable(dst, n, src, length, work.dtable, work.flags)
        if lib.HUF_isError(got) or got != n:
            raise ValueError("corrupt Huffman-coded literals")


def _literal_blocks(lib: Any, frame: Any, src: int, length: int, dst: int, size: int) -> bool:
    blocks = _parse(frame, src, length, size)
    if blocks is None:
        return False
    for block in blocks:
        _put(lib, block, dst)
        dst += block[3]
    return True
