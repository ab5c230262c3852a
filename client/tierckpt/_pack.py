"""Packing the many small shards of one save into one stored shard (client side only).

A save with at least ``pack_min_shards`` shards smaller than ``pack_below`` bytes stores them as
ONE shard, :data:`PACK`: each at an offset aligned to :data:`ALIGN` bytes (zeros between), so
views of any dtype are aligned. A small JSON shard, :data:`INDEX`, records per packed shard its
name, position among the save's shards, offset, size, dtype, shape and checksum (xxh3, as every
shard's). The daemon sees two ordinary shards (replication, the persistent tier, verification and
repair are unchanged) instead of thousands of files, each costing syscalls at BeginSave, copy and
commit. Restore maps (or streams) the pack once and hands out views at the offsets, under the
original names, in the original order.

The index is fixed-width (checksums are 16 hex digits), so its size is known at BeginSave and the
checksums are computed after save() returned, off the blocking path. It is read back from disk,
so everything in it is validated before use (:func:`decode_index`): a bad index is a
:class:`DataLossError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import mmap
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._buffers import ShardBuffer, torch_dtype_numpy
from .common import checksum as _checksum
from .common.names import SHARD_RE
from .errors import DataLossError, InternalError, InvalidArgumentError

__all__ = ["RESERVED_PREFIX", "PACK", "INDEX", "ALIGN", "Entry", "Layout", "check_name", "plan", "encode_index",
           "decode_index", "fill", "digest_pack", "finish_staged", "stream_pieces", "unpack"]

RESERVED_PREFIX = "__tierckpt_"
PACK = "__tierckpt_pack__"
INDEX = "__tierckpt_pack_index__"
ALIGN = 64
FORMAT = "tierckpt-pack/1"
_BATCH = 16 << 20  # bytes per copy / hash task, as in _transfer
_HEX16 = re.compile(r"[0-9a-f]{16}")
_TORCH_NAME = re.compile(r"[a-z0-9_]{1,26}")
_MAX_DIMS = 64


@dataclass(frozen=True)
class Entry:
    """One packed shard."""

    name: str
    position: int  # index among all shards of the save (restore keeps the order)
    offset: int  # in the pack, a multiple of ALIGN
    size: int
    dtype: str
    shape: tuple[int, ...]
    checksum: str = ""  # filled when read back from an index


@dataclass(frozen=True)
class Layout:
    """Where the small shards of one save go; cached per save layout by the client."""

    entries: tuple[Entry, ...]  # in save order, which is also offset order
    packed: tuple[int, ...]  # their indexes among the save's buffers
    unpacked: tuple[int, ...]  # the shards stored as ordinary shards
    count: int  # shards in the save
    size: int  # bytes of the pack
    index_size: int = 0  # bytes of the encoded index (fixed width)


def check_name(name: str, field: str = "shards") -> None:
    """Refuse a user shard name in the reserved namespace."""
    if name.startswith(RESERVED_PREFIX):
        raise InvalidArgumentError(f"{field}: {name!r} uses the reserved prefix {RESERVED_PREFIX!r}")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan(buffers: Sequence[ShardBuffer], below: int, min_shards: int) -> Layout | None:
    """The pack layout of a save, or None when it has fewer than ``min_shards`` shards under
    ``below`` bytes (either 0 disables packing)."""
    if below <= 0 or min_shards <= 0:
        return None
    small = [i for i, b in enumerate(buffers) if b.nbytes < below]
    if len(small) < min_shards:
        return None
    entries, end = [], 0
    for i in small:
        b = buffers[i]
        off = _align(end)
        entries.append(Entry(b.name, i, off, b.nbytes, b.dtype, tuple(b.shape)))
        end = off + b.nbytes
    taken = set(small)
    layout = Layout(tuple(entries), tuple(small), tuple(i for i in range(len(buffers)) if i not in taken),
                    len(buffers), end)
    return replace(layout, index_size=len(encode_index(layout, ["0" * 16] * len(entries))))


def encode_index(layout: Layout, digests: Sequence[str]) -> bytes:
    """The index JSON, padded with spaces to ``layout.index_size`` once that is known."""
    doc = {"format": FORMAT, "align": ALIGN, "pack_size": layout.size, "count": layout.count,
           "shards": [{"name": e.name, "position": e.position, "offset": e.offset, "size": e.size,
                       "dtype": e.dtype, "shape": list(e.shape), "checksum": d}
                      for e, d in zip(layout.entries, digests, strict=True)]}
    data = json.dumps(doc, separators=(",", ":")).encode()
    if layout.index_size:
        if len(data) > layout.index_size:  # checksums are fixed-width: cannot happen
            raise InternalError(f"pack index is {len(data)} bytes, {layout.index_size} were reserved")
        data += b" " * (layout.index_size - len(data))
    return data


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_layout(name: str, size: int, dtype: object, shape: object) -> str | None:
    """Why a packed shard's dtype and shape do not fit its size (None: they do)."""
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        return f"shard {name!r}: bad shape"
    if not isinstance(dtype, str) or len(dtype) > 32:
        return f"shard {name!r}: bad dtype"
    if dtype == "":
        return f"shard {name!r}: a shape without a dtype" if shape else None
    if dtype.startswith("torch:"):
        if not _TORCH_NAME.fullmatch(dtype[6:]):
            return f"shard {name!r}: bad dtype {dtype!r}"
        npdt = torch_dtype_numpy(dtype)  # None: no numpy twin (bfloat16, float8): size unchecked
    else:
        try:
            npdt = np.dtype(dtype)
        except (TypeError, ValueError, SyntaxError):
            return f"shard {name!r}: bad dtype {dtype!r}"
        if npdt.str != dtype or npdt.hasobject:
            return f"shard {name!r}: bad dtype {dtype!r}"
    if npdt is not None and math.prod(shape) * npdt.itemsize != size:
        return f"shard {name!r}: shape {shape} of {dtype} does not fill {size} bytes"
    return None


def decode_index(data: Any, pack_size: int, others: Sequence[str], where: str) -> list[Entry]:
    """The validated entries of an index read back; ``others`` are the save's unpacked shards.

    Raises:
        DataLossError: the index is malformed, or inconsistent with the pack or the other shards.
    """
    def bad(why: str) -> DataLossError:
        return DataLossError(f"{where}: the pack index is corrupt: {why}")

    try:
        doc = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError):
        raise bad("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("align") != ALIGN:
        raise bad("unknown format")
    rows, count = doc.get("shards"), doc.get("count")
    if doc.get("pack_size") != pack_size:
        raise bad(f"pack_size {doc.get('pack_size')!r} but the pack is {pack_size} bytes")
    if not isinstance(rows, list) or not _is_int(count) or count != len(rows) + len(others):
        raise bad(f"count {count!r} does not match the stored shards")
    names, positions, end, out = set(others), set(), 0, []
    for row in rows:
        if not isinstance(row, dict):
            raise bad("an entry is not an object")
        fields: list[Any] = [row.get(k) for k in ("name", "position", "offset", "size", "dtype", "shape", "checksum")]
        name, pos, off, size, dtype, shape, digest = fields
        if (not isinstance(name, str) or not SHARD_RE.fullmatch(name) or ".." in name
                or name.startswith(RESERVED_PREFIX) or name in names):
            raise bad(f"invalid or repeated shard name {str(name)[:64]!r}")
        if not _is_int(pos) or not 0 <= pos < count or pos in positions:
            raise bad(f"shard {name!r}: invalid or repeated position {pos!r}")
        if not (_is_int(off) and _is_int(size)) or off % ALIGN or off < end or size < 0 or off + size > pack_size:
            raise bad(f"shard {name!r}: bytes {off!r}+{size!r} misaligned, overlapping or outside the pack")
        if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
            raise bad(f"shard {name!r}: bad checksum")
        why = _check_layout(name, size, dtype, shape)
        if why:
            raise bad(why)
        names.add(name)
        positions.add(pos)
        end = off + size
        out.append(Entry(name, pos, off, size, dtype, tuple(shape), digest))  # type: ignore[arg-type]
    return out


# ------------------------------------------------------------------ saving

def fill(dst: int | np.ndarray, batch: list[tuple[int, Entry, memoryview]]) -> None:
    """Copy packed shards into the staged pack, zeroing the gap before each: ``dst`` is a
    writable uint8 array over a kept map, or a file descriptor. Items: (gap start, entry, view)."""
    from ._transfer import pwrite_all  # the one pwrite of the data path (tests replace it)

    for gap, e, view in batch:
        if isinstance(dst, np.ndarray):
            dst[gap : e.offset] = 0
            if e.size:
                np.copyto(dst[e.offset : e.offset + e.size], np.frombuffer(view, dtype=np.uint8))
        else:
            if e.offset > gap:
                pwrite_all(dst, memoryview(bytes(e.offset - gap)), gap)
            pwrite_all(dst, view, e.offset)


def fill_batches(layout: Layout, views: Sequence[memoryview]) -> list[list[tuple[int, Entry, memoryview]]]:
    """The :func:`fill` items of a save, in batches of about 16 MiB."""
    out: list[list] = [[]]
    n, prev = 0, 0
    for e, v in zip(layout.entries, views, strict=True):
        out[-1].append((prev, e, v))
        prev, n = e.offset + e.size, n + e.size
        if n >= _BATCH:
            out.append([])
            n = 0
    return [b for b in out if b]


def digest_pack(io: cf.Executor, target: str | mmap.mmap, layout: Layout) -> tuple[list[str], str]:
    """Checksums of each packed shard and of the whole staged pack (a kept map, or a path)."""
    if layout.size == 0:
        empty = _checksum.digest(b"")
        return [empty] * len(layout.entries), empty
    if isinstance(target, mmap.mmap):
        return _digest_mapped(io, target, layout)
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ) as mm:
            return _digest_mapped(io, mm, layout)
    finally:
        os.close(fd)


def finish_staged(io: cf.Executor, kept: Any, layout: Layout, target: str | mmap.mmap,
                  index_path: str) -> dict[str, str]:
    """After a shared-dir save returned: hash the staged pack and each packed shard, write the
    index into its staging file; returns the checksums of the pack and the index."""
    from ._transfer import MAP_MIN, write_files

    if isinstance(target, str) and layout.size >= MAP_MIN:
        # Hashed through a kept map (StagingMaps): the save that recycles this file copies into it.
        target = kept.get(target, layout.size) or target
    parts, pack_digest = digest_pack(io, target, layout)
    index = encode_index(layout, parts)
    write_files([(index_path, memoryview(index))])
    return {PACK: pack_digest, INDEX: _checksum.digest(index)}


def _digest_mapped(io: cf.Executor, mm: Any, layout: Layout) -> tuple[list[str], str]:
    from ._transfer import run_batched

    with memoryview(mm) as mv:
        whole = io.submit(_checksum.digest, mv[: layout.size])
        parts = run_batched(io, lambda e: _checksum.digest(mv[e.offset : e.offset + e.size]),
                            list(layout.entries), lambda e: e.size)
        return parts, whole.result()


def stream_pieces(layout: Layout, views: Sequence[memoryview], digests: list[str],
                  chunk: int) -> Iterator[tuple[int, bytes]]:
    """The pack as (offset, bytes) pieces of about ``chunk`` bytes, for a streamed save; appends
    each packed shard's checksum to ``digests`` as it goes."""
    cur, base = bytearray(), 0
    for e, v in zip(layout.entries, views, strict=True):
        cur += bytes(e.offset - base - len(cur))
        digests.append(_checksum.digest(v))
        pos = 0
        while pos < e.size:
            take = min(e.size - pos, max(chunk - len(cur), 1))
            cur += v[pos : pos + take]
            pos += take
            if len(cur) >= chunk:
                yield base, bytes(cur)
                base, cur = base + len(cur), bytearray()
    if cur:
        yield base, bytes(cur)


# ------------------------------------------------------------------ restoring

Row = tuple[str, str, tuple[int, ...], Any]
"""(name, dtype, shape, buffer) of one restored shard, as the caller sees it."""


def is_packed(shards: Sequence[Any]) -> bool:
    names = {s.name for s in shards}
    return PACK in names and INDEX in names


def unpack(io: cf.Executor, shards: Sequence[Any], bufs: Sequence[Any], verify: bool,
           where: str) -> tuple[list[Row], Any]:
    """The caller's shards of a restore, in save order, and the pack buffer (None if unpacked).

    Packed shards are views into the one pack buffer; with ``verify`` each is checked against its
    checksum in the index.

    Raises:
        DataLossError: a corrupt index, or a packed shard failing its checksum.
    """
    if not is_packed(shards):
        return [(s.name, s.dtype, tuple(s.shape), b) for s, b in zip(shards, bufs, strict=True)], None
    by_name = {s.name: (s, b) for s, b in zip(shards, bufs, strict=True)}
    others = [(s, b) for s, b in zip(shards, bufs, strict=True) if s.name not in (PACK, INDEX)]
    pack_spec, pack = by_name[PACK]
    index = by_name[INDEX][1]
    entries = decode_index(index, pack_spec.size, [s.name for s, _ in others], where)
    if isinstance(index, mmap.mmap):
        index.close()  # parsed: not handed out
    view = memoryview(pack)
    if verify:
        from ._transfer import run_batched

        def check(e: Entry) -> None:
            with view[e.offset : e.offset + e.size] as part:
                actual = _checksum.digest(part)
            if actual != e.checksum:
                raise DataLossError(f"{where} shard {e.name!r} (packed): checksum mismatch "
                                    f"(expected {e.checksum}, got {actual})")

        run_batched(io, check, entries, lambda e: e.size)
    rows: list[Row | None] = [None] * (len(entries) + len(others))
    for e in entries:
        rows[e.position] = (e.name, e.dtype, e.shape, view[e.offset : e.offset + e.size])
    rest = iter(others)
    for i, r in enumerate(rows):
        if r is None:
            s, b = next(rest)
            rows[i] = (s.name, s.dtype, tuple(s.shape), b)
    return rows, pack  # type: ignore[return-value]
