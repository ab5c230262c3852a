"""Drain take-over under parity (issue 32 item 4), real daemons on loopback: the owner of a
selected rank is killed -9 after its commit and before its drain; the first live member of its
parity group after it reconstructs the rank from parity (XOR for parity:2+1, Reed-Solomon for
parity:4+2) and drains it to the persistent tier (``file://`` on tmpfs), byte-exact and under the
owner's names; the owner coming back does not make anyone drain it again."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from tierckpt.common import checksum as _checksum
from tierckptd.backends import open_backend
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import manifest_key

from ..harness import free_port, wait_until

GRACE = 1.5
KNOBS = f"refresh_interval=0.2,down_retry_max=0.5,takeover_grace={GRACE},takeover_check_interval=0.2"


def _shards(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step * 100 + rank)
    return {"a": rng.integers(0, 255, 300_001 + 17 * rank, dtype=np.uint8),
            "b": rng.integers(0, 255, 4_099, dtype=np.uint8)}


@pytest.mark.parametrize("k,m", [(2, 1), (4, 2)])
def test_a_protector_reconstructs_and_drains_a_dead_owners_rank(daemon_factory, scratch: Path, k: int, m: int):
    bucket = scratch / "bucket"
    ids = [f"n{i}" for i in range(k + m)]
    ports = {n: free_port() for n in ids}
    common = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "0",
              "--redundancy", f"parity:{k}+{m}", "--persistent", f"file://{bucket}", "--persist-every", "2")

    def start(node: str, knobs: str):
        return daemon_factory(node, port=ports[node], args=(*common, "--knobs", knobs))

    nodes = {n: start(n, KNOBS + (",debug_drain_delay=600" if n == "n0" else "")) for n in ids}
    with nodes["n0"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} == set(ids) - {"n0"}, 30, "n0 sees its group")
        futs = [c.save("job", step, 0, 2, _shards(step, 0)) for step in (2, 3)]  # step 3 is not selected
        for f in futs:
            f.wait("peer", timeout=90)  # its parity is on every other member
    with nodes["n1"].client() as c:  # the other rank: drained by its owner
        c.save("job", 2, 1, 2, _shards(2, 1)).wait("persistent", timeout=90)
    with open_backend(f"file://{bucket}") as be:
        key = manifest_key("job", 2, 0, 2)
        assert not be.exists(key)  # the owner's drain is held back
        nodes["n0"].kill()
        t0 = time.monotonic()
        wait_until(lambda: be.exists(key), 90, "n1 to reconstruct and drain rank 0", 0.2)
        assert time.monotonic() - t0 >= GRACE
        first = be.get_bytes(key)
        assert Manifest.from_json(first).node == "n0"  # under the owner's name
        assert be.list("job/manifests/00000000000000000003/") == []  # not selected: not drained
    log1 = nodes["n1"].log_text()
    assert "parity take-over: reconstructing job step 2 rank 0" in log1
    assert "taking over the drain of job step 2 rank 0" in log1
    for n in ids[2:]:
        assert "take-over" not in nodes[n].log_text() and "taking over" not in nodes[n].log_text()
    # the owner comes back (its drain no longer held back): nobody reconstructs or takes over again
    nodes["n0"].args = (*common, "--knobs", KNOBS)
    nodes["n0"].start()
    with nodes["n1"].client() as c:
        wait_until(lambda: any(p.node_id == "n0" and p.up for p in c.status().peers), 30, "n1 sees n0 back")
    time.sleep(4 * 0.2 + 1.0)
    log1 = nodes["n1"].log_text()
    assert log1.count("parity take-over: reconstructing job step 2 rank 0") == 1
    assert log1.count("taking over the drain of job step 2 rank 0") == 1
    with open_backend(f"file://{bucket}") as be:
        assert be.get_bytes(manifest_key("job", 2, 0, 2)) == first
    for d in nodes.values():
        d.kill()
    fresh = daemon_factory("fresh", args=("--persistent", f"file://{bucket}"))  # every node lost
    with fresh.client() as c:
        assert c.latest("job") == 2
        for rank in (0, 1):
            ck = c.restore("job", rank)
            assert ck.tier == "persistent" and ck.step == 2
            want = _shards(2, rank)
            assert {n: _checksum.digest(np.asarray(a)) for n, a in ck.shards.items()} == {
                n: _checksum.digest(a) for n, a in want.items()}
            assert {n: bytes(np.asarray(a)) for n, a in ck.shards.items()} == {n: bytes(a) for n, a in want.items()}
