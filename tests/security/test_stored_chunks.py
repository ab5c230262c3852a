"""A bucket writer cannot crash or grow a daemon through the chunks it restores (issue 27, item 2).

A real daemon drains float shards (content layout, ``auto``: byte planes + zstd) to a real object
store (the file backend, and a bucket of moto's S3 server); the test then writes the bucket as an
attacker would and restores a step whose manifest names what it planted: an object larger than
its chunk, a zstd frame announcing 1 TiB, a manifest declaring one 384 MiB chunk for a 12 KiB
object, and a ZipNN stream (legacy codec) with a recomputed digest that crashes ZipNN's C decoder.
Each restore is DataLossError; the daemon's peak memory stays bounded, its decoder crash stays in
a child process, and the daemon goes on serving saves and restores.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tierckpt.errors import DataLossError
from tierckptd.backends import open_backend
from tierckptd.persistent import compress, manifest_key
from tierckptd.persistent.layout import content_key

from ..servers import BackendTarget, make_backend_target

pytestmark = pytest.mark.slow


def _peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def _frame(size: int) -> bytes:
    """A zstd frame announcing ``size`` bytes (one 1-byte RLE block)."""
    return struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", size) + (11).to_bytes(3, "little") + b"\0"


def _crashing_zipnn(plain: bytes) -> bytes:
    """A zipnn-bf16 chunk of ``plain`` with bits of its stream flipped and its digest recomputed,
    one that ZipNN's C decoder dies on (found by trying; decoded in a child, as the daemon does)."""
    import xxhash

    stored = compress.encode("zipnn-bf16", plain)
    end = len(stored) - len(plain) % 2
    rng = random.Random(27)
    for _ in range(2000):
        stream = bytearray(stored[9:end])
        for _ in range(rng.randrange(1, 4)):
            stream[rng.randrange(32, len(stream))] ^= 1 << rng.randrange(8)
        digest = xxhash.xxh3_64_intdigest(bytes(stream) + stored[end:]).to_bytes(8, "little")
        forged = b"\x01" + digest + bytes(stream) + stored[end:]
        try:
            compress.decode("zipnn-bf16", forged, len(plain))
        except DataLossError as err:
            if "signal" in str(err):
                return forged
    raise AssertionError("no forged ZipNN stream crashed the decoder in 2,000 tries")


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path: Path, monkeypatch) -> BackendTarget:
    """The bucket: a file:// directory, or a bucket of a real S3-compatible server (moto)."""
    return make_backend_target(request.param, request, tmp_path, monkeypatch)


def test_a_bucket_writer_can_neither_crash_nor_grow_the_daemon(daemon_factory, store: BackendTarget) -> None:
    url = store.url
    x = (np.random.default_rng(27).standard_normal(200_000) * 0.02).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    d = daemon_factory("a", args=("--persistent", url, "--persist-every", "1"), env=store.env)
    with d.client() as c:
        c.save("job", 1, 0, 1, {"w": x}).wait("persistent", timeout=60)
    be = open_backend(url)
    doc = json.loads(be.get_bytes(manifest_key("job", 1, 0, 1)))
    (shard,) = doc["shards"]
    assert shard["codec"] == "bp4-zstd" and len(shard["chunks"]) == 1
    digest, size, _ = shard["chunks"][0]
    key = content_key("job", digest, size, "bp4-zstd")
    good = be.get_bytes(key)
    step = 1

    def restore_forged(edit_shard: Any = None) -> None:
        nonlocal step
        step += 1
        forged = json.loads(json.dumps(doc))
        forged["step"] = step
        if edit_shard:
            edit_shard(forged["shards"][0])
        be.put_bytes(manifest_key("job", step, 0, 1), json.dumps(forged).encode())
        with d.client() as c, pytest.raises(DataLossError):
            c.restore("job", 0, step=step)
        assert d.alive()

    before = _peak_rss(d.proc.pid)
    be.put_bytes(key, good + b"\0" * (4 << 20))  # larger than its chunk: refused before its body is read
    restore_forged()
    body, pos = bytes(good[1:]), 0  # a valid body whose exponent plane's frame announces 1 TiB
    for _ in range(3):
        pos += 5 + int.from_bytes(body[pos + 1:pos + 5], "little")
    planes = bytearray(b"\x01" + body[:pos] + b"\x01" + len(_frame(1 << 40)).to_bytes(4, "little") + _frame(1 << 40))
    be.put_bytes(key, bytes(planes))
    restore_forged()
    be.put_bytes(key, good)

    big = 384 << 20  # a manifest declaring one 384 MiB chunk for a 12 KiB object

    def huge(s: dict) -> None:
        s.update(size=big, shape=[big // 4], checksum=s["checksum"], chunks=[["ab" * 16, big, 12288]])
    be.put_bytes(content_key("job", "ab" * 16, big, "bp4-zstd"), b"\x01" + _frame(big) + bytes(12272))
    restore_forged(huge)
    assert _peak_rss(d.proc.pid) - before < 64 << 20  # nothing near 384 MiB was allocated

    # legacy ZipNN: the C decoder dies on this stream, in its own process; the daemon goes on
    plain = bf16.tobytes()
    with d.client() as c:
        c.save("job", 50, 0, 1, {"w": bf16}).wait("persistent", timeout=60)
    doc = json.loads(be.get_bytes(manifest_key("job", 50, 0, 1)))
    ((digest, size, _),) = doc["shards"][0]["chunks"]
    assert size == len(plain)
    be.put_bytes(content_key("job", digest, size, "zipnn-bf16"), _crashing_zipnn(plain))
    step = 50
    restore_forged(lambda s: s.update(codec="zipnn-bf16"))
    be.put_bytes(content_key("job", digest, size, "zipnn-bf16"), compress.encode("zipnn-bf16", plain))
    step += 1
    forged = dict(doc, step=step, shards=[dict(doc["shards"][0], codec="zipnn-bf16")])
    be.put_bytes(manifest_key("job", step, 0, 1), json.dumps(forged).encode())
    with d.client() as c:  # an intact legacy chunk restores, and the daemon serves as before
        assert c.restore("job", 0, step=step).shards["w"].tobytes() == plain
        c.save("job", 100, 0, 1, {"w": x}).wait("persistent", timeout=60)
        assert c.restore("job", 0, step=100).shards["w"].tobytes() == x.tobytes()
    assert d.alive()
    be.close()
    log = d.log_path.read_text()  # each refusal for its reason
    for reason in ("accepted (not read)", "frame announces 1099511627776 bytes", "names a chunk over 8388608 bytes",
                   "ZipNN's decoder failed on it (signal"):
        assert reason in log, reason
