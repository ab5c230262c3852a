"""README, "Peer tier" / "Lost owners": a selected rank whose owner died before draining it is
drained to the persistent tier by its first live holder (after ``takeover_grace``), under the
owner's object names. tests/persistent/test_takeover.py checks the rule in process with the
in-memory store, tests/persistent/test_drain.py with ``file://``; here on real daemons and a
real S3-compatible server (moto): the owner cannot reach its bucket, dies, a peer drains its
rank, and a node of an empty cluster restores the step from the bucket."""

from __future__ import annotations

import secrets
import time

from tierckptd.backends import open_backend
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import manifest_key, object_keys

from ..harness import free_port, wait_until
from ..servers import make_backend_target
from ._util import noise

GRACE = 2.0
KNOBS = f"refresh_interval=0.2,down_retry_max=0.5,takeover_grace={GRACE},takeover_check_interval=0.2"


def _shards(step: int, rank: int) -> dict[str, bytes]:
    return {"model": noise(200_000, step, rank), "optim": noise(3_000, step, rank, 1)}


def test_a_replica_holder_drains_a_dead_owners_rank_to_s3(daemon_factory, request, tmp_path, monkeypatch) -> None:
    s3 = make_backend_target("s3", request, tmp_path, monkeypatch)
    unreachable = f"s3://no-such-bucket-{secrets.token_hex(4)}/ckpt"  # n0 cannot drain
    ports = {n: free_port() for n in ("n0", "n1", "n2")}
    common = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "1",
              "--persist-every", "2", "--knobs", KNOBS)

    def start(node: str, url: str):
        return daemon_factory(node, port=ports[node], env=s3.env, args=(*common, "--persistent", url))

    nodes = {"n0": start("n0", unreachable), "n1": start("n1", s3.url), "n2": start("n2", s3.url)}
    with nodes["n0"].client() as c:
        wait_until(lambda: all(p.up for p in c.status().peers), 30, "n0 to see its peers")
        futs = [c.save("job", step, 0, 2, _shards(step, 0)) for step in (2, 3)]  # step 3 is not selected
        for f in futs:
            f.wait("peer", timeout=60)  # replicas on n1, the next node on the ring
    with nodes["n1"].client() as c:  # n1's own rank: its owner drains it
        c.save("job", 2, 1, 2, _shards(2, 1)).wait("persistent", timeout=60)
    with open_backend(s3.url) as be:
        key = manifest_key("job", 2, 0, 2)
        assert not be.exists(key)  # the owner could not drain it
        t0 = time.monotonic()
        nodes["n0"].kill()
        wait_until(lambda: be.exists(key), 60, "n1 to take over the drain of rank 0", 0.2)
        assert time.monotonic() - t0 >= GRACE
        man = Manifest.from_json(be.get_bytes(key))
        assert man.node == "n0"  # stored under the owner's name
        stored = set(be.list("job/"))
        assert object_keys(man) <= stored  # every chunk the manifest names is in the bucket
        assert be.list("job/manifests/00000000000000000003/") == []  # not selected: not drained
    assert "taking over the drain of job step 2 rank 0" in nodes["n1"].log_text()
    assert "taking over" not in nodes["n2"].log_text()
    for node in nodes.values():
        node.kill()
    fresh = daemon_factory("fresh", env=s3.env, args=("--persistent", s3.url))  # every node lost
    with fresh.client() as c:
        assert c.latest("job") == 2
        for rank in (0, 1):
            ck = c.restore("job", rank)
            assert ck.tier == "persistent" and ck.step == 2
            assert {n: bytes(a) for n, a in ck.shards.items()} == _shards(2, rank)
