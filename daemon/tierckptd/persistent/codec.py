"""The codec registry: every way the persistent tier stores bytes, found by the name a manifest records.

Two kinds of codec share one registry (one name space, :func:`register_codec`), one per layout
(:mod:`.layout`):

- a :class:`ChunkCodec` codes one chunk of the content layout (bytes in, bytes out); the
  built-in ones (``raw``, ``zstd``, ``bg2-zstd``, ``bg4-zstd``, ``zipnn-*``) are defined and
  registered by :mod:`.compress`, which also picks one per shard (:func:`.compress.choose`);
- a :class:`ShardCodec` transforms a whole shard file of the per-shard layout, described below.

Production and tests register through the same :func:`register_codec`; a reader finds a
codec with :func:`codec_named` (per-shard) or :func:`chunk_codec` (content), and a name no
codec has is a :class:`DataLossError`.

Per-shard codecs (the transform seam: how one shard's bytes are stored whole):

Every shard passes through a :class:`ShardCodec` on its way up (:meth:`ShardCodec.encoded`) and
down (:meth:`ShardCodec.download_into`). The default, :data:`IDENTITY`, stores the bytes as they
are, with no copy. A codec other than the identity (compression, later) is recorded per shard in
the uploaded manifest (``shards[].codec``, absent for the identity, so manifests written
through the identity are byte for byte those of before the seam), and a reader picks the codec
by that name (:func:`codec_named`). Checksums always cover the uncompressed bytes: the local
commit of a download verifies what the codec decoded.

Call order, per shard, from a worker thread:

- upload: ``with codec.encoded(path) as src: backend.put_file(key, src)``;
- download: ``codec.download_into(lambda tmp: backend.get_file(key, tmp), path)``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from tierckpt.errors import DataLossError

__all__ = ["ShardCodec", "ChunkCodec", "IdentityCodec", "IDENTITY", "register_codec", "codec_named", "chunk_codec",
           "is_chunk_codec"]


class ShardCodec(abc.ABC):
    """A reversible transform of one shard's bytes (blocking; called from worker threads).

    Attributes:
        name: recorded in the manifest for every shard it stored; ``"identity"`` is recorded as
            no name at all. ``[a-z0-9-]+``, unique among registered codecs.
    """

    name: str = ""

    @abc.abstractmethod
    def encoded(self, path: Path) -> contextlib.AbstractContextManager[Path]:
        """A context giving the file to upload for the shard at ``path`` (left untouched);
        anything it created is removed on exit."""

    @abc.abstractmethod
    def download_into(self, get: Callable[[Path], None], path: Path) -> None:
        """Fill ``path`` (an existing, sized staging file) with the decoded bytes.

        Args:
            get: downloads the stored object into the file it is given (replacing it).
            path: the staging file of the shard.

        Raises:
            DataLossError: the stored bytes cannot be decoded.
        """


class IdentityCodec(ShardCodec):
    """Stores the bytes unchanged: uploads the file itself, downloads straight into place."""

    name = "identity"

    @contextlib.contextmanager
    def encoded(self, path: Path) -> Iterator[Path]:
        yield path

    def download_into(self, get: Callable[[Path], None], path: Path) -> None:
        get(path)


IDENTITY = IdentityCodec()
"""The default per-shard codec."""


class ChunkCodec(abc.ABC):
    """A lossless code of one chunk of the content layout (blocking; called from worker threads).
    The tag byte and the "stored raw when it does not shrink" rule are :mod:`.compress`'s.

    Attributes:
        name: recorded in the manifest for every shard whose chunks it coded (``[a-z0-9-]+``).
        overwrites_input: :meth:`pack` with ``consume`` rewrites the buffer it is given.
    """

    name: str = ""
    overwrites_input: bool = False

    @abc.abstractmethod
    def pack(self, data: bytes | bytearray | memoryview, consume: bool) -> list[bytes] | None:
        """The coded body of ``data`` as parts to join, or None when this codec cannot code it.
        ``consume``: ``data`` is a bytearray the caller is done with (it may be overwritten).
        A part may be a view of a buffer the calling thread keeps (the byte planes): it is valid
        until this thread's next :meth:`pack` (:func:`.compress.encode` joins the parts and
        :func:`.compress.encode_into` writes them out before returning)."""

    @abc.abstractmethod
    def unpack(self, body: memoryview, size: int) -> bytes | bytearray:
        """The ``size`` plain bytes of a coded body (never more: the size bounds the output).

        Raises:
            DataLossError (or any exception: the caller reports it as data loss): not a body of
                this codec and size.
        """


_CODECS: dict[str, ShardCodec | ChunkCodec] = {"": IDENTITY, IDENTITY.name: IDENTITY}


def _registry() -> dict[str, ShardCodec | ChunkCodec]:
    if "raw" not in _CODECS:  # the built-in chunk codecs register when .compress is first imported
        from . import compress  # noqa: F401
    return _CODECS


def register_codec(codec: ShardCodec | ChunkCodec) -> None:
    """Make ``codec`` readable by name (every codec a tier may write with must be registered).

    Raises:
        ValueError: another codec has that name.
    """
    held = _registry().get(codec.name)
    if held is not None and type(held) is not type(codec):
        raise ValueError(f"codec name {codec.name!r} is taken by {type(held).__name__}")
    _CODECS[codec.name] = codec


def codec_named(name: str) -> ShardCodec:
    """The per-shard codec a manifest names for a shard ("" is the identity).

    Raises:
        DataLossError: no such codec is known to this daemon.
    """
    codec = _registry().get(name)
    if not isinstance(codec, ShardCodec):
        raise DataLossError(f"shard stored with unknown codec {name!r}")
    return codec


def chunk_codec(name: str) -> ChunkCodec:
    """The chunk codec a manifest names for a shard of the content layout.

    Raises:
        DataLossError: no such chunk codec is known to this daemon.
    """
    codec = _registry().get(name)
    if not isinstance(codec, ChunkCodec):
        raise DataLossError(f"chunk stored with unknown codec {name!r}")
    return codec


def is_chunk_codec(name: str) -> bool:
    """Whether ``name`` is a registered chunk codec (a shard stored in the content layout)."""
    return isinstance(_registry().get(name), ChunkCodec)
