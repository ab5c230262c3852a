"""README, "Persistent tier", against a real S3-compatible server (moto), not the in-memory fake
or ``file://``: the content layout stores a chunk once per job (an unchanged shard's chunks are
not stored again by later steps); ``--keep-persistent`` deletes old steps, manifests first, and
the collection then deletes exactly the chunks no kept manifest names; a job with more than
1,000 objects (moto, like S3, lists 1,000 keys per page) is listed and collected whole, never
asking to delete more than S3's 1,000 keys in one request (moto would accept more: the requests
are counted on their way). Every restore is from a wiped node and byte for byte."""

from __future__ import annotations

import pytest
import tierckpt
from tierckptd.backends import open_backend
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import manifest_key, object_keys
from tierckptd.persistent.layout import chunk_keys

from ..harness import wait_until
from ..servers import make_backend_target
from ._util import Proxy, bucket_keys, delete_batches, noise

CHUNK = 64 << 10  # small chunks: a few hundred KiB make several


@pytest.fixture
def s3(request, tmp_path, monkeypatch):
    return make_backend_target("s3", request, tmp_path, monkeypatch)


def _daemon(daemon_factory, target, *more: str, env: dict[str, str] | None = None):
    return daemon_factory("n0", env=env or target.env, args=(
        "--persistent", target.url, "--persist-every", "1", f"--knobs=chunk_bytes={CHUNK},gc_interval=0.5", *more))


def _keys(target, under: str) -> list[str]:
    """Keys of the bucket under the job's ``under`` folder, relative to the URL's prefix."""
    bucket, prefix = target.url[len("s3://"):].split("/", 1)
    return [k[len(prefix) + 1:] for k in bucket_keys(target.server, bucket, f"{prefix}/job/{under}/")]


def _manifest(target, step: int) -> Manifest:
    with open_backend(target.url) as be:
        return Manifest.from_json(be.get_bytes(manifest_key("job", step, 0, 1)))


def _frozen() -> bytes:
    return noise(4 * CHUNK, 7)  # 4 chunks, the same every step


def _moving(step: int) -> bytes:
    return noise(2 * CHUNK, 100 + step)  # 2 chunks, new every step


def _restore_after_wipe(d, steps) -> None:
    d.kill()
    d.wipe()
    d.start()
    with d.client() as c:
        for step in steps:
            ck = c.restore("job", 0, step=step)
            assert ck.tier == "persistent" and ck.step == step
            assert bytes(ck.shards["frozen"]) == _frozen() and bytes(ck.shards["moving"]) == _moving(step)


def test_an_unchanged_shard_is_stored_once_across_steps(daemon_factory, s3) -> None:
    d = _daemon(daemon_factory, s3)
    with d.client() as c:
        for step in (1, 2, 3):
            c.save("job", step, 0, 1, {"frozen": _frozen(), "moving": _moving(step)}).wait("persistent", timeout=60)
    content = _keys(s3, "content")
    assert len(content) == 4 + 3 * 2  # the frozen shard's 4 chunks once, 2 new chunks per step
    mans = [_manifest(s3, step) for step in (1, 2, 3)]
    frozen = [chunk_keys("job", next(s for s in m.shards if s.name == "frozen")) for m in mans]
    assert len(frozen[0]) == 4 and frozen[0] == frozen[1] == frozen[2]
    assert set().union(*(object_keys(m) for m in mans)) == set(content)
    assert len(_keys(s3, "manifests")) == 3
    _restore_after_wipe(d, (1, 3))


def test_retention_deletes_old_steps_and_collects_only_their_chunks(daemon_factory, s3) -> None:
    d = _daemon(daemon_factory, s3, "--keep-persistent", "2")
    with d.client() as c:
        for step in (1, 2, 3, 4):
            c.save("job", step, 0, 1, {"frozen": _frozen(), "moving": _moving(step)}).wait("persistent", timeout=60)
    wait_until(lambda: len(_keys(s3, "manifests")) == 2, 30, "retention of steps 1 and 2")
    kept = {k.split("/")[2] for k in _keys(s3, "manifests")}
    assert kept == {f"{3:020d}", f"{4:020d}"}
    named = object_keys(_manifest(s3, 3)) | object_keys(_manifest(s3, 4))
    assert len(named) == 4 + 2 * 2  # the shared chunks are named by both kept steps
    wait_until(lambda: set(_keys(s3, "content")) == named, 30, "the collection of steps 1 and 2's own chunks")
    _restore_after_wipe(d, (3, 4))
    with d.client() as c, pytest.raises(tierckpt.NotFoundError):
        c.restore("job", 0, step=1)


def test_more_than_1000_objects_are_listed_and_collected(daemon_factory, s3) -> None:
    n = 1100  # one rank of 1,100 small distinct shards: 1,100 chunk objects
    shards = {f"s{i:04d}": noise(64, 1, i) for i in range(n)}
    proxy = Proxy(("127.0.0.1", s3.server.port))  # the daemon's S3 requests, to count keys per delete
    try:
        _listed_and_collected(daemon_factory, s3, proxy, shards)
        batches = delete_batches(proxy)
        print("DeleteObjects batches:", batches)
        assert sum(batches) >= n and max(batches) <= 1000  # S3's limit per request (moto does not enforce it)
    finally:
        proxy.close()


def _listed_and_collected(daemon_factory, s3, proxy: Proxy, shards: dict[str, bytes]) -> None:
    n = len(shards)
    d = _daemon(daemon_factory, s3, "--keep-persistent", "1", env={**s3.env, "AWS_ENDPOINT_URL": proxy.url})
    with d.client(pack_below=0) as c:  # no packing: every shard is its own chunk
        c.save("job", 1, 0, 1, shards).wait("persistent", timeout=180)
        assert len(_keys(s3, "content")) == n  # two pages of ListObjectsV2
        with open_backend(s3.url) as be:
            assert len(be.list("job/content/")) == n  # the daemon's own listing reads every page
        c.save("job", 2, 0, 1, {"x": noise(64, 2)}).wait("persistent", timeout=60)
    wait_until(lambda: len(_keys(s3, "manifests")) == 1, 30, "retention of step 1")
    named = object_keys(_manifest(s3, 2))
    assert len(named) == 1
    # the collection lists all 1,101 chunks and deletes 1,100 (DeleteObjects takes 1,000 at most)
    wait_until(lambda: set(_keys(s3, "content")) == named, 120, "the collection of step 1's 1,100 chunks")
    d.kill()
    d.wipe()
    d.start()
    with d.client() as c:
        ck = c.restore("job", 0)
        assert ck.step == 2 and ck.tier == "persistent" and bytes(ck.shards["x"]) == noise(64, 2)
