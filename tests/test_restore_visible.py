"""Restores are visible: the daemon's fetch from the persistent tier reports bytes and tier
(RestoreProgress, polled by Client.restore for a three-argument progress callback, drawn by the
CLI), the client logs one INFO line per save and per restore, and warns once when it streams over
gRPC because it cannot see the daemon's local dir. Real daemons (processes), real files."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb

from .tty import run_on_tty

SHARDS = {f"s{i:02d}": np.full(64 << 10, i, np.float32) for i in range(12)}  # 12 x 256 KiB
NBYTES = sum(a.nbytes for a in SHARDS.values())
PACE = ("--knobs", "fetch_pace=0.05")  # 12 shards: ~0.6 s of fetch to watch


@pytest.fixture()
def in_store(daemon_factory, tmp_path):
    """A rank only in the object store; a fresh node (slowed fetch) to restore it through."""
    store = ("--persistent", f"file://{tmp_path}/bucket")
    first = daemon_factory("n0", args=store)
    with first.client() as c:
        c.save("vis", 5, 0, 1, SHARDS, persist=True).wait("persistent", timeout=60)
    first.kill()
    return lambda node: daemon_factory(node, args=store + PACE)


def test_fetch_progress_reports_bytes_and_tier(in_store):
    d = in_store("n1")
    seen: list[tuple[int, int, str]] = []
    two: list[tuple[int, int]] = []
    with tierckpt.Client(d.address) as c:
        idle = c._stub.RestoreProgress(pb.RestoreProgressRequest(job="vis", rank=0))
        assert not idle.fetching  # nothing in flight
        ck = c.restore("vis", 0, progress=lambda done, total, tier: seen.append((done, total, tier)))
        assert ck.tier == "persistent" and np.array_equal(ck.shards["s07"], SHARDS["s07"])
        ck.close()
        c.restore("vis", 0, progress=lambda done, total: two.append((done, total)))  # now local
    fetch = [s for s in seen if s[2] == "persistent"]
    copy = [s for s in seen if s[2] == "local"]
    assert seen.index(fetch[-1]) < seen.index(copy[0])  # the daemon's fetch, then this process's copy
    assert {t for _, t, _ in fetch} == {NBYTES} and fetch[-1][0] == NBYTES
    assert any(0 < done < NBYTES for done, _, _ in fetch), fetch  # watched while in flight
    assert [d for d, _, _ in fetch] == sorted(d for d, _, _ in fetch)
    assert copy[-1][:2] == (NBYTES, NBYTES)
    assert two and two[-1] == (NBYTES, NBYTES)  # a two-argument callback: the copy only, as before


def test_cli_draws_the_daemons_fetch(in_store, tmp_path):
    d = in_store("n2")
    p, drawn = run_on_tty([sys.executable, "-m", "tierckpt.cli", "--address", d.address, "restore", "vis",
                            "--rank", "0", "--out", str(tmp_path / "o")])
    assert p.returncode == 0
    text = drawn.decode()
    assert "daemon fetching from the persistent tier" in text and "3.0 MiB/3.0 MiB" in text, text
    assert text.index("persistent tier") < text.rindex("reading")


def test_one_info_line_per_save_and_restore(daemon, caplog):
    caplog.set_level(logging.INFO, logger="tierckpt.client")
    with daemon.client() as c:
        c.save("logs", 1, 0, 1, {"w": np.ones(1000, np.float32)}).result(30)
        c.restore("logs", 0).close()
    lines = [r for r in caplog.records if r.name == "tierckpt.client"]
    assert [r.levelname for r in lines] == ["INFO", "INFO"], [r.getMessage() for r in lines]
    saved, restored = (r.getMessage() for r in lines)
    assert saved.startswith("saved logs step 1 rank 0 into the local tier: 4000 bytes in ") and "s (caller" in saved
    assert restored.startswith("restored logs step 1 rank 0 from the local tier: 4000 bytes in ") and \
        "mapped" in restored


_HIDDEN_CLIENT = textwrap.dedent("""
    import logging, sys
    import numpy as np, tierckpt
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    with tierckpt.Client(sys.argv[1]) as c:
        for step in (1, 2, 3):
            c.save("hid", step, 0, 1, {f"s{i}": np.full(100, i, np.int32) for i in range(3)}).result(30)
        for _ in range(2):
            ck = c.restore("hid", 0)
            assert np.array_equal(ck.shards["s2"], np.full(100, 2, np.int32))
    print("ok")
""")


def test_streaming_fallback_warns_once_saying_why(daemon, tmp_path):
    """A client that cannot see the daemon's local dir (here: a tmpfs over it, in the client's own
    mount namespace, as in a pod without the volume) streams, and says so once, with the reason."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare --mount (root or user namespaces) to hide the local dir from the client")
    script = tmp_path / "client.py"
    script.write_text(_HIDDEN_CLIENT)
    local = str(daemon.local_dir)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'mount -t tmpfs none "{local}" && exec "$0" "$@"', sys.executable, str(script),
                        daemon.address], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("WARNING tierckpt.client")]
    assert len(warnings) == 1, p.stderr  # once per client, not per shard, save or restore
    assert f"cannot read {local}/.fs-token" in warnings[0] and "stream" in warnings[0]
    infos = [ln for ln in p.stderr.splitlines() if ln.startswith("INFO tierckpt.client")]
    assert sum("saved hid" in ln and "streamed" in ln for ln in infos) == 3
    assert sum("restored hid" in ln and "streamed over gRPC" in ln for ln in infos) == 2


def test_fetch_from_a_peer_is_reported_as_the_peer_tier(daemon_factory):
    from .harness import Cluster

    cl = Cluster(daemon_factory, 2)
    data = {"w": np.random.default_rng(0).integers(0, 255, 24 << 20, dtype=np.uint8)}
    with cl.d["n0"].client() as c:
        assert c.save("pv", 1, 0, 1, data).wait("peer", timeout=60) == ["n1"]
    cl.replace("n0")  # its local copy is gone; n1 holds the replica
    seen: list[tuple[int, int, str]] = []
    with cl.d["n0"].client() as c:
        ck = c.restore("pv", 0, progress=lambda done, total, tier: seen.append((done, total, tier)))
        assert ck.tier == "peer" and np.array_equal(ck.shards["w"], data["w"])
        ck.close()
    peer = [s for s in seen if s[2] == "peer"]
    assert peer and peer[-1] == (24 << 20, 24 << 20, "peer") and {t for _, t, _ in peer} == {24 << 20}
    assert [d for d, _, _ in peer] == sorted(d for d, _, _ in peer)
    assert seen[-1] == (24 << 20, 24 << 20, "local")
