"""README, "The CLI" and "`--json`": ``tierckpt status --json`` gives the peer tier (configured,
replicas, every peer with its address, whether it is up, when it was last seen and its last
error) and the persistent tier (configured, URL, drain backlog in ranks and bytes, the oldest
entry's age, ``error`` null while the tier works), absent values as ``null``. Checked on a real
daemon with one live peer, one configured peer that never started and an S3 (moto) persistent
tier whose drain is held back so that the backlog shows."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from ..harness import free_port, wait_until
from ..servers import make_backend_target
from ._util import noise

FAST = "refresh_interval=0.2,down_retry_max=0.5"


def _cli(address: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierckpt.cli", "--address", address, *argv],
                          capture_output=True, text=True, timeout=60)


def test_status_json_lists_peers_and_the_persistent_tier_with_its_backlog(daemon_factory, request, tmp_path,
                                                                          monkeypatch) -> None:
    target = make_backend_target("s3", request, tmp_path, monkeypatch)
    ports = {n: free_port() for n in ("n0", "n1", "n2")}  # n2 is configured and never started
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    t_start = time.time()
    daemon_factory("n1", port=ports["n1"], args=("--peers", peers, "--replicas", "1", "--knobs", FAST))
    n0 = daemon_factory("n0", port=ports["n0"], env=target.env, args=(
        "--peers", peers, "--replicas", "1", "--persistent", target.url, "--persist-every", "1",
        "--knobs", FAST + ",debug_drain_delay=600"))  # the rank waits in the drain queue
    shards = {"model": noise(300_000, 1), "optim": noise(5_000, 2)}
    with n0.client() as c:
        wait_until(lambda: {p.node_id: p.up for p in c.status().peers} == {"n1": True, "n2": False}, 30,
                   "n1 up and n2 down in n0's view")
        c.save("job", 1, 0, 1, shards).wait("peer", timeout=60)  # committed, copied to n1, not drained

    p = _cli(n0.address, "status", "--json")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    doc = json.loads(p.stdout)
    assert doc["node_id"] == "n0" and doc["uptime_seconds"] > 0
    assert doc["local_tier"]["dir"] == str(n0.local_dir)
    assert doc["local_tier"]["used_bytes"] >= 305_000 and doc["local_tier"]["capacity_bytes"] > 0

    peer = doc["peer_tier"]
    assert peer["configured"] is True and peer["replicas"] == 1
    by_id = {q["node_id"]: q for q in peer["peers"]}
    assert sorted(by_id) == ["n1", "n2"]  # this node's own id is not a peer
    n1, n2 = by_id["n1"], by_id["n2"]
    assert n1["address"] == f"127.0.0.1:{ports['n1']}" and n1["up"] is True
    assert t_start - 1 <= n1["last_seen_unix"] <= time.time() + 1
    assert n1["last_error"] is None  # absent: null
    assert n2["address"] == f"127.0.0.1:{ports['n2']}" and n2["up"] is False
    assert isinstance(n2["last_error"], str) and n2["last_error"]  # why it is down
    assert n2["last_seen_unix"] is None  # never seen: null, not 1970

    pers = doc["persistent_tier"]
    assert pers["configured"] is True and pers["url"] == target.url and pers["error"] is None
    assert pers["backlog_ranks"] == 1 and pers["backlog_bytes"] == 305_000
    assert isinstance(pers["oldest_age_seconds"], (int, float)) and pers["oldest_age_seconds"] >= 0
    assert doc["jobs"] == [{"job": "job", "steps": 1, "latest": 1, "bytes": doc["jobs"][0]["bytes"]}]
    assert doc["jobs"][0]["bytes"] >= 305_000

    text = _cli(n0.address, "status")  # the same facts in the table
    assert text.returncode == 0, text.stderr
    assert "peer tier: 1 copy of every rank; 1 of 2 peers up" in text.stdout, text.stdout
    assert f"persistent tier: {target.url}: backlog 1 ranks" in text.stdout, text.stdout
    assert "DEGRADED" not in text.stdout
