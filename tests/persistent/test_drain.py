"""Persistent tier end to end: real daemons draining to file://, moto (s3://) and fake-gcs-server (gs://)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tierckpt
from tierckptd.backends import open_backend
from tierckptd.local.manifest import Manifest, ShardEntry
from tierckptd.persistent import (
    DrainQueue,
    data_key,
    manifest_key,
    not_selected_reason,
    object_keys,
    parse_manifest_key,
    plan_retention,
    selected,
)

from ..harness import free_port, wait_until
from ..metrics_scrape import scrape as _metrics
from ..threads import Checked

MiB = 1 << 20


def _shards(step: int, rank: int, nbytes: int = 64 * 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step * 1000 + rank)
    return {"model": rng.integers(0, 255, nbytes, dtype=np.uint8),
            "optim": rng.standard_normal((16, 8)).astype(np.float32)}


def _queued_or_drained(d, be, step: int, rank: int) -> bool:
    if (d.local_dir / "drain-queue" / f"job.{step:020d}.{rank:07d}.json").exists():
        return True
    return bool(be.list(f"job/manifests/{step:020d}/rank-{rank:07d}-"))


def _noise(nbytes: int, seed: int) -> np.ndarray:
    """Incompressible bytes, new per seed (stored as they are, never deduplicated)."""
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def _until(predicate, timeout: float, what: str, interval: float = 0.05):
    return wait_until(predicate, timeout, what, interval)


def _backlog(d) -> int:
    with d.client() as c:
        return c.status().drain_backlog_steps


def _persistent(url: str, *more: str) -> tuple[str, ...]:
    return ("--persistent", url, *more)  # the content layout, the default


def _named(be, man: Manifest) -> set[str]:
    """The data objects a stored manifest names that are in the store."""
    return object_keys(man) & set(be.list(f"{man.job}/"))


# --------------------------------------------------------------------------------- pure parts


def test_selection_layout_and_retention_plan(tmp_path: Path) -> None:
    man = Manifest("job", 30, 1, 4, "n0", "g1", (ShardEntry("model", 3, "0" * 16, file="model.abc"),))
    assert selected(man, 10) and selected(man, 3) and not selected(man, 7) and not selected(man, 0)
    assert selected(Manifest(**{**man.__dict__, "persist": True}), 0)
    assert not_selected_reason(Manifest(**{**man.__dict__, "step": 7}), 10) == \
        "job step 7 is not selected for the persistent tier: persist_every=10 and persist=False"
    key = manifest_key("job", 30, 1, 4)
    assert key == "job/manifests/00000000000000000030/rank-0000001-of-0000004.json"
    assert parse_manifest_key("job", key) == (30, 1, 4)
    assert parse_manifest_key("jo", key) is None and parse_manifest_key("job", "job/data/x") is None
    assert data_key("job", 30, 1, man.shards[0]) == "job/data/00000000000000000030/rank-0000001/model.abc"
    steps = {1: {0: 2, 1: 2}, 2: {0: 2}, 3: {0: 2, 1: 2}, 4: {0: 2, 1: 2}, 5: {0: 2}}
    assert plan_retention(steps, 0) == []
    assert plan_retention(steps, 2) == [1, 2]  # incomplete 2 is older than the kept complete 3
    assert plan_retention(steps, 3) == []
    assert plan_retention(steps, 1) == [1, 2, 3]
    queue = DrainQueue(tmp_path / "q", fsync=False)
    assert queue.load() == []
    queue.put(man, 5.0)
    (tmp_path / "q" / ".leftover.tmp").write_text("x")
    (tmp_path / "q" / "bad.00000000000000000001.0000000.json").write_text("{")
    assert [(d["job"], d["step"], d["rank"], d["generation"]) for d in queue.load()] == [("job", 30, 1, "g1")]
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["job.00000000000000000030.0000001.json"]
    queue.remove("job", 30, 1)
    assert queue.load() == []


# --------------------------------------------------------------------------------- every backend


def test_drain_then_restore_on_a_brand_new_cluster(daemon_factory, backend_target) -> None:
    """Steps selected by persist_every or persist=True drain; a node with an empty local dir restores them."""
    url = backend_target.url
    mport = free_port()
    a = daemon_factory("a", args=_persistent(url, "--persist-every", "2", "--metrics-port", str(mport)))
    with a.client() as c:
        futs = {(step, rank): c.save("job", step, rank, 2, _shards(step, rank), metadata={"step": step},
                                     persist=step == 1)
                for step in (1, 2, 3, 4) for rank in (0, 1)}
        for f in futs.values():
            f.result(30)
        for step in (1, 2, 4):
            for rank in (0, 1):
                assert futs[step, rank].wait("persistent", timeout=60) == [url]
        with pytest.raises(tierckpt.TierError, match="step 3 is not selected .*persist_every=2 and persist=False"):
            futs[3, 0].wait("persistent", timeout=10)
        st = c.status()
        assert (st.drain_backlog_steps, st.drain_backlog_bytes, st.persistent_url) == (0, 0, url)
        infos = {i.step: i for i in c.list("job")}
        assert "persistent" in infos[4].tiers and "persistent" not in infos[3].tiers
        assert infos[1].tiers == ("persistent",)  # beyond keep_local: evicted locally once drained
    values = _metrics(mport)
    assert values['tierckpt_saves_total{result="ok",tier="persistent"}'] == 6
    assert values["tierckpt_drain_backlog_bytes"] == 0
    nbytes = sum(sum(a.nbytes for a in _shards(s, r).values()) for s in (1, 2, 4) for r in (0, 1))
    assert values['tierckpt_saved_bytes_total{tier="persistent"}'] == nbytes
    assert 0 < values["tierckpt_drained_bytes_total"] <= nbytes + 12  # stored bytes: compressed, deduplicated
    a.kill()
    assert list((a.local_dir / "drain-queue").iterdir()) == []

    with open_backend(url) as be:  # the documented layout
        assert be.list("job/manifests/") == [manifest_key("job", s, r, 2) for s in (1, 2, 4) for r in (0, 1)]
        man = Manifest.from_json(be.get_bytes(manifest_key("job", 4, 1, 2)))
        assert all(s.chunks and not s.file for s in man.shards) and be.list("job/data/") == []
        assert _named(be, man) == object_keys(man) and len(object_keys(man)) == 2
        assert be.list("job/leases/") == [] and be.list("job/gc/") == []

    b = daemon_factory("b", args=_persistent(url))  # a brand-new node: empty local dir
    with b.client() as c:
        assert c.latest("job") == 4
        for rank in (0, 1):
            ck = c.restore("job", rank)
            assert (ck.step, ck.tier, ck.metadata) == (4, "persistent", {"step": 4})
            for name, arr in _shards(4, rank).items():
                np.testing.assert_array_equal(ck.shards[name], arr)
        assert c.restore("job", 0, step=1).tier == "persistent"
        assert c.restore("job", 0).tier == "local"  # the download was committed into the local tier
        with pytest.raises(tierckpt.NotFoundError):
            c.restore("job", 0, step=3)
        assert c.status().drain_backlog_steps == 0  # downloaded copies are not drained again


# --------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("backend_target", ["gs"], indirect=True)
def test_kill9_mid_drain_resumes_and_never_shows_a_partial_rank(daemon_factory, backend_target) -> None:
    url, world = backend_target.url, 4
    violations: list[str] = []
    seen: set[str] = set()  # manifests the watcher found complete
    rounds = [0]  # full passes over the bucket
    stop = threading.Event()

    def watch() -> None:  # a reader polling the bucket: every visible manifest must name stored shards
        with open_backend(url) as be:
            while not stop.is_set():
                keys = set(be.list("job/"))
                for key in [k for k in keys if k.startswith("job/manifests/")]:
                    assert parse_manifest_key("job", key), key
                    man = Manifest.from_json(be.get_bytes(key))
                    missing = object_keys(man) - keys
                    if missing:
                        violations.append(f"{key} visible without {sorted(missing)}")
                    seen.add(key)
                rounds[0] += 1
                time.sleep(0.01)

    watcher = Checked(watch)
    watcher.start()
    a = daemon_factory("a", args=_persistent(url, "--persist-every", "1"))
    killed_mid = False
    try:
        with open_backend(url) as be:
            for step in (1, 2, 3):  # until the kill lands mid-drain (the drain may be too quick)
                with a.client() as c:
                    for f in [c.save("job", step, r, world, {"a": np.full((4 + 6 * r) * MiB, r, np.uint8),
                                                              "b": _noise(3 * MiB, step)})
                              for r in range(world)]:
                        f.result(30)
                _until(lambda: all(_queued_or_drained(a, be, step, r) for r in range(world)), 30,
                       "every rank durable in the drain queue (it is written just after the commit)")
                _until(lambda: be.list("job/leases/"), 30, "a drain in flight")
                a.kill()
                done = len(be.list(f"job/manifests/{step:020d}/"))
                if done < world:
                    killed_mid = True
                    assert list((a.local_dir / "drain-queue").iterdir()), "pending ranks are queued durably"
                    break
                a.start()
        assert killed_mid, "the daemon was never killed mid-drain"
        a.start()  # the same node restarts: its drain queue resumes
        _until(lambda: _backlog(a) == 0, 60, "the resumed drain")
        with open_backend(url) as be:
            final = set(be.list(f"job/manifests/{step:020d}/"))
        assert len(final) == world
        after = rounds[0]  # the watcher checks the finished bucket at least once in full
        _until(lambda: rounds[0] > after + 1 or not watcher.is_alive(), 60, "a watcher pass over the drained step")
    finally:
        stop.set()
        watcher.join(60)  # re-raises what failed in the watcher
    assert violations == []
    assert final <= seen, "the watcher never checked the drained step's manifests"
    b = daemon_factory("b", args=_persistent(url))
    with b.client() as c:
        assert c.latest("job") == step
        for r in range(world):
            ck = c.restore("job", r)
            assert ck.tier == "persistent" and int(ck.shards["a"].min()) == int(ck.shards["a"].max()) == r
            assert ck.shards["a"].nbytes == (4 + 6 * r) * MiB


# ~80 s (the GCS SDK's own retries run out before the daemon's backoff shows): `make test-long`,
# which CI runs too; tests/faults/test_matrix.py's store down/hung rows stay in `make test`.
@pytest.mark.long
@pytest.mark.parametrize("backend_target", ["gs"], indirect=True)
def test_outage_delays_drains_and_the_backlog_drains_when_the_store_returns(daemon_factory, backend_target) -> None:
    url, server = backend_target.url, backend_target.server
    mport = free_port()
    args = _persistent(url, "--persist-every", "1", "--shutdown-timeout", "2")
    a = daemon_factory("a", args=(*args, "--metrics-port", str(mport)))
    with a.client() as c:
        c.save("job", 1, 0, 1, _shards(1, 0)).wait("persistent", timeout=30)
        server.stop()
        try:
            futs = [c.save("job", step, 0, 1, _shards(step, 0)) for step in (2, 3, 4)]
            with pytest.raises(tierckpt.DeadlineExceededError):
                futs[0].wait("persistent", timeout=1.5)
            t0 = time.monotonic()
            assert c.latest("job") == 4  # the local tier answers; the unreachable store holds it up <= 5 s
            # README: a source that does not answer is left out; 30 s is room for a loaded machine,
            # far below a wait on the stopped store (the SDK retries for minutes).
            assert time.monotonic() - t0 < 30
            st = c.status()
            assert st.drain_backlog_steps == 3 and st.drain_oldest_age_seconds > 1
            assert _metrics(mport)["tierckpt_drain_backlog_bytes"] == st.drain_backlog_bytes > 0
            t0 = time.monotonic()
            assert a.terminate(timeout=90) == 0  # a graceful stop during the outage keeps the queue
            # README: SIGTERM waits --shutdown-timeout (2 s here), not for the store; 30 s is room for
            # a loaded machine, far below a stop that waited for the outage to end.
            assert time.monotonic() - t0 < 30
            a.start()
            assert _backlog(a) == 3
            # The SDK's own retries give up after 15 s; then the daemon's backoff takes over.
            _until(lambda: _metrics(mport)["tierckpt_drain_failures_total"] >= 1, 45, "a failed attempt", 0.5)
        finally:
            server.start()
    _until(lambda: _backlog(a) == 0, 90, "the backlog to drain")
    with open_backend(url) as be:
        assert be.list("job/manifests/") == [manifest_key("job", s, 0, 1) for s in (1, 2, 3, 4)]
    b = daemon_factory("b", args=_persistent(url))
    with b.client() as c:
        ck = c.restore("job", 0)
        assert ck.step == 4 and ck.tier == "persistent"
        np.testing.assert_array_equal(ck.shards["model"], _shards(4, 0)["model"])


@pytest.mark.parametrize("layout", ["content", "per-shard"])
def test_corrupted_objects_are_detected_and_not_returned(daemon_factory, tmp_path: Path, layout: str) -> None:
    root = tmp_path / "store"
    url = root.as_uri()
    a = daemon_factory("a", args=_persistent(url, "--persist-every", "1", "--persistent-layout", layout))
    with a.client() as c:
        for step in (1, 2):
            c.save("job", step, 0, 1, _shards(step, 0)).wait("persistent", timeout=30)
    a.kill()
    man = Manifest.from_json((root / manifest_key("job", 1, 0, 1)).read_bytes())
    data = root / object_keys(dataclasses.replace(man, shards=(man.shard("model"),))).pop()
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # same size, one bit pattern changed
    data.write_bytes(raw)
    (root / manifest_key("job", 2, 0, 1)).write_text('{"format": 1, "job": "job"')  # truncated manifest

    mport = free_port()
    b = daemon_factory("b", args=_persistent(url, "--metrics-port", str(mport)))
    with b.client() as c:
        with pytest.raises(tierckpt.DataLossError, match="checksum mismatch"):
            c.restore("job", 0, step=1)
        with pytest.raises(tierckpt.DataLossError, match="corrupt"):
            c.restore("job", 0, step=2)
        assert c.status().jobs == []  # nothing was committed locally
    assert list(b.local_dir.glob("jobs/*/*/*/manifest.json")) == []
    assert _metrics(mport)['tierckpt_checksum_failures_total{tier="persistent"}'] == 2
    assert "failed verification" in b.log_text()


def test_a_failing_drain_is_reported_and_capacity_eviction_fails_it_loudly(daemon_factory) -> None:
    """file:///dev/null/... fails with ENOTDIR (not retryable); the steps stay queued until capacity evicts one."""
    mport = free_port()
    d = daemon_factory(args=_persistent("file:///dev/null/store", "--persist-every", "1", "--local-capacity",
                                        "3MiB", "--metrics-port", str(mport)))
    blob = np.zeros(MiB - 4096, np.uint8)
    with d.client() as c:
        first = c.save("job", 1, 0, 1, {"x": blob})
        with pytest.raises(tierckpt.TierError, match="drain to file:///dev/null/store failed: .*Not a directory"):
            first.wait("persistent", timeout=30)
        for step in (2, 3, 4):  # step 4 only fits if undrained step 1 goes
            c.save("job", step, 0, 1, {"x": blob}).result(30)
        with pytest.raises(tierckpt.TierError, match=r"evicted from the local tier before it was drained "
                                                     r"\(capacity_undrained\)"):
            first.wait("persistent", timeout=10)
        assert c.status().drain_backlog_steps == 3
        assert [i.step for i in c.list("job")] == [2, 3, 4]
    values = _until(lambda: (v := _metrics(mport))["tierckpt_drain_failures_total"] >= 5 and v, 60,
                    "a failed attempt per step and the final failure of step 1")
    assert values['tierckpt_evictions_total{reason="capacity_undrained"}'] == 1
    assert values['tierckpt_saves_total{result="error",tier="persistent"}'] == 1
    assert "evicting job step 1 before it was drained" in d.log_text()


def test_keep_persistent_and_resave(daemon_factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    d = daemon_factory(args=_persistent(root.as_uri(), "--persist-every", "1", "--keep-persistent", "2"))
    with d.client() as c:
        for step in (1, 2, 3):
            c.save("job", step, 0, 1, {"x": b"v1-%d" % step}).wait("persistent", timeout=30)
        c.save("job", 3, 0, 1, {"x": b"v2-3", "y": b"new"}).wait("persistent", timeout=30)  # re-save of step 3
        c.save("job", 4, 0, 1, {"x": b"v1-4"}).wait("persistent", timeout=30)

    def steps() -> list[str]:
        with open_backend(root.as_uri()) as be:
            return sorted({k.split("/")[2] for k in be.list("job/manifests/")})

    def named() -> set[str]:
        with open_backend(root.as_uri()) as be:
            mans = [Manifest.from_json(be.get_bytes(manifest_key("job", s, 0, 1))) for s in (3, 4)]
            return set().union(*(object_keys(m) for m in mans))

    _until(lambda: steps() == [f"{3:020d}", f"{4:020d}"], 60, "retention of steps 1 and 2")
    with open_backend(root.as_uri()) as be:  # the re-save replaced the manifest; unnamed chunks are collected
        assert len(named()) == 3 and be.list("job/data/") == []
        _until(lambda: set(be.list("job/content/")) == named(), 60, "the collection of steps 1 and 2 and v1-3")
    d.kill()
    d.wipe()
    d.start()
    with d.client() as c:
        ck = c.restore("job", 0, step=3)
        assert ck.tier == "persistent" and bytes(ck.shards["x"]) == b"v2-3" and bytes(ck.shards["y"]) == b"new"
        with pytest.raises(tierckpt.NotFoundError):
            c.restore("job", 0, step=1)


def test_whole_cluster_loss_with_peers_restores_from_the_persistent_tier(daemon_factory, tmp_path: Path) -> None:
    """Each node drains the ranks it owns (not its replicas); a cluster of wiped nodes restores every rank."""
    url = (tmp_path / "store").as_uri()
    ports = {n: free_port() for n in ("n0", "n1")}
    args = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "1",
            *_persistent(url, "--persist-every", "1"))

    def start(node: str):
        return daemon_factory(node, port=ports[node], args=args)

    nodes = {n: start(n) for n in ports}
    for rank, node in enumerate(nodes.values()):
        with node.client() as c:
            fut = c.save("job", 1, rank, 2, _shards(1, rank))
            fut.wait("peer", timeout=60)
            fut.wait("persistent", timeout=60)
    with open_backend(url) as be:
        owners = [Manifest.from_json(be.get_bytes(manifest_key("job", 1, r, 2))).node for r in (0, 1)]
    assert owners == ["n0", "n1"]
    for rank, (name, node) in enumerate(nodes.items()):
        log_text = node.log_text()
        assert "drained job step 1 rank %d " % rank in log_text
        assert "drained job step 1 rank %d " % (1 - rank) not in log_text, f"{name} drained a replica"
    for node in nodes.values():
        node.kill()
        node.wipe()
    nodes = {n: start(n) for n in ports}
    for rank, node in enumerate(nodes.values()):
        with node.client() as c:
            assert c.latest("job") == 1
            ck = c.restore("job", rank)
            assert ck.tier == "persistent" and ck.step == 1
            np.testing.assert_array_equal(ck.shards["model"], _shards(1, rank)["model"])


def test_a_replica_holder_takes_over_the_drain_of_a_dead_owner(daemon_factory, tmp_path: Path) -> None:
    """n0 cannot drain (its URL is unwritable) and dies; n1, first holder of its replica, drains it instead."""
    url = (tmp_path / "store").as_uri()
    ports = {n: free_port() for n in ("n0", "n1", "n2")}
    common = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "1",
              "--persist-every", "2")

    def start(node: str, store_url: str = url):
        return daemon_factory(node, port=ports[node], args=(*common, *_persistent(store_url)))

    nodes = {"n0": start("n0", "file:///dev/null/store"), "n1": start("n1"), "n2": start("n2")}
    with nodes["n0"].client() as c:
        futs = [c.save("job", step, 0, 2, _shards(step, 0)) for step in (2, 3)]  # step 3 is not selected
        for f in futs:
            f.wait("peer", timeout=60)  # replicas on n1, the next node on the ring
        with pytest.raises(tierckpt.TierError, match="Not a directory"):
            futs[0].wait("persistent", timeout=30)
    with nodes["n1"].client() as c:  # n1's own rank, replicated to n2: its owner stays up and drains it
        c.save("job", 2, 1, 2, _shards(2, 1)).wait("persistent", timeout=60)
    t0 = time.monotonic()
    nodes["n0"].kill()
    with open_backend(url) as be:
        key = manifest_key("job", 2, 0, 2)
        _until(lambda: be.exists(key), 90, "n1 to take over the drain of rank 0", 0.2)
        assert time.monotonic() - t0 >= 10  # the grace period
        man = Manifest.from_json(be.get_bytes(key))
        assert man.node == "n0"  # the owner's manifest, unchanged
        assert _named(be, man) == object_keys(man) and be.list("job/data/") == []
        assert be.list("job/manifests/00000000000000000003/") == []
    _until(lambda: _backlog(nodes["n1"]) == 0, 60, "n1's backlog")
    # the whole logs: n1 logs every failed reconnect to the dead n0, which can push a line out of a tail
    assert "taking over the drain of job step 2 rank 0" in nodes["n1"].log_path.read_text(errors="replace")
    assert "taking over" not in nodes["n2"].log_path.read_text(errors="replace")  # n1's own rank: its owner is up
    for node in nodes.values():
        node.kill()
        node.wipe()
    nodes = {n: start(n) for n in ports}
    for rank, name in enumerate(("n0", "n1")):
        with nodes[name].client() as c:
            assert c.latest("job") == 2
            ck = c.restore("job", rank)
            assert ck.tier == "persistent" and ck.step == 2
            for shard, arr in _shards(2, rank).items():
                np.testing.assert_array_equal(ck.shards[shard], arr)


def test_a_per_shard_bucket_restores_and_goes_on_in_the_content_layout(daemon_factory, tmp_path: Path) -> None:
    """Steps drained in the per-shard layout (an older daemon, or the option) restore on a default
    daemon, which drains new steps as chunks; retention removes the old layout's objects."""
    url = (tmp_path / "store").as_uri()
    old = daemon_factory("old", args=_persistent(url, "--persist-every", "1", "--persistent-layout", "per-shard"))
    with old.client() as c:
        for step in (1, 2):
            c.save("job", step, 0, 1, _shards(step, 0)).wait("persistent", timeout=30)
    old.kill()
    with open_backend(url) as be:
        assert len(be.list("job/data/")) == 4 and be.list("job/content/") == []
    new = daemon_factory("new", args=_persistent(url, "--persist-every", "1", "--keep-persistent", "2"))
    with new.client() as c:
        ck = c.restore("job", 0, step=2)
        assert ck.tier == "persistent"
        np.testing.assert_array_equal(ck.shards["model"], _shards(2, 0)["model"])
        c.save("job", 3, 0, 1, _shards(3, 0)).wait("persistent", timeout=30)
    with open_backend(url) as be:
        _until(lambda: be.list("job/manifests/00000000000000000001/") == [], 60, "retention of step 1")
        man = Manifest.from_json(be.get_bytes(manifest_key("job", 3, 0, 1)))
        assert _named(be, man) == object_keys(man) and all(s.chunks for s in man.shards)
        _until(lambda: len(be.list("job/data/")) == 2, 60, "step 1's data objects deleted")
    new.kill()
    new.wipe()
    new.start()
    with new.client() as c:
        for step in (2, 3):
            ck = c.restore("job", 0, step=step)
            assert ck.tier == "persistent"
            for name, arr in _shards(step, 0).items():
                np.testing.assert_array_equal(ck.shards[name], arr)
