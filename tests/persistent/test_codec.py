"""The transform seam: a codec other than the identity is recorded per shard and read back."""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from tierckptd.manifest import Manifest
from tierckptd.persistent import ShardCodec, manifest_key, register_codec

from .rig import Rig


class _Zlib(ShardCodec):
    name = "test-zlib"

    @contextlib.contextmanager
    def encoded(self, path: Path) -> Iterator[Path]:
        out = path.with_name(path.name + ".z")
        out.write_bytes(zlib.compress(path.read_bytes()))
        try:
            yield out
        finally:
            out.unlink()

    def download_into(self, get: Callable[[Path], None], path: Path) -> None:
        tmp = path.with_name(path.name + ".z")
        get(tmp)
        path.write_bytes(zlib.decompress(tmp.read_bytes()))
        tmp.unlink()


def test_a_codec_transforms_the_stored_bytes_and_checksums_cover_the_plain_ones(tmp_path: Path) -> None:
    register_codec(_Zlib())
    plain = b"checkpoint " * 1000

    async def body() -> None:
        writer = Rig(tmp_path, node_id="a", codec=_Zlib())
        await writer.tier.start()
        saved = writer.save("job", 1, 0, {"model": plain})
        await asyncio.wait_for(writer.tier.wait("job", 1, 0, None), 10)
        stored = Manifest.from_json(writer.memory.get_bytes(manifest_key("job", 1, 0, 1)))
        assert [(s.codec, s.checksum, s.size) for s in stored.shards] == \
            [("test-zlib", saved.shards[0].checksum, len(plain))]
        data_keys = writer.memory.list("job/data/")
        assert len(data_keys) == 1 and zlib.decompress(writer.memory.get_bytes(data_keys[0])) == plain
        await writer.tier.stop(1.0)

        reader = Rig(tmp_path, node_id="b", memory=writer.memory)
        await reader.tier.start()
        local = await reader.tier.fetch("job", 1, 0)
        assert reader.store.shard_path(local, "model").read_bytes() == plain
        await reader.tier.stop(1.0)

    asyncio.run(body())


def test_the_identity_leaves_manifests_as_they_were() -> None:
    man = Manifest("job", 1, 0, 1, "n0", "g", ())
    assert b"codec" not in Manifest.from_json(man.to_json()).to_json()
