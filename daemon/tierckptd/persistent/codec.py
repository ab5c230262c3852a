"""The transform seam: how one shard's bytes are stored in the object store.

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

__all__ = ["ShardCodec", "IdentityCodec", "IDENTITY", "register_codec", "codec_named"]


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
"""The default codec."""

_CODECS: dict[str, ShardCodec] = {"": IDENTITY, IDENTITY.name: IDENTITY}


def register_codec(codec: ShardCodec) -> None:
    """Make ``codec`` readable by name (every codec a tier may write with must be registered)."""
    _CODECS[codec.name] = codec


def codec_named(name: str) -> ShardCodec:
    """The codec a manifest names for a shard ("" is the identity).

    Raises:
        DataLossError: no such codec is known to this daemon.
    """
    codec = _CODECS.get(name)
    if codec is None:
        raise DataLossError(f"shard stored with unknown codec {name!r}")
    return codec
