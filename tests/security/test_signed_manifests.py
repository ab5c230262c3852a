"""Signed manifests against real daemons and a real object store (the file:// backend, and moto's
S3 server): whoever can write the bucket or the local dir cannot make a daemon restore, count or
replicate a manifest it forged or edited (issue 27, item 1).

The attacker here holds everything but the cluster's manifest key: they copy a real manifest to a
newer step, edit a manifest's metadata or world size, sign with a key of their own, or strip the
MAC. Every such step is invisible to ``latest`` and ``ls``, a restore of it is DataLossError, and
``verify`` names it; the steps the cluster wrote stay readable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import numpy as np
import pytest
from tierckpt.errors import DataLossError, NotFoundError, TierError
from tierckptd.backends import open_backend

from ..harness import Cluster
from ..servers import BackendTarget, make_backend_target
from ._util import run_daemon

JOB = "signed"


def _key(path: Path, seed: bytes) -> Path:
    path.write_bytes(hashlib.sha256(seed).hexdigest().encode())  # 64 bytes of text: a valid key
    path.chmod(0o600)
    return path


def _manifest_key(step: int, rank: int = 0, world: int = 1) -> str:
    return f"{JOB}/manifests/{step:020d}/rank-{rank:07d}-of-{world:07d}.json"


def _body(doc: dict, key: bytes | None) -> bytes:
    """``doc`` as a manifest: MAC'd with ``key`` (an attacker's), or without one (None)."""
    doc = {k: v for k, v in doc.items() if k != "mac"}
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    if key is not None:
        doc["mac"] = hmac.new(key, body, hashlib.sha256).hexdigest()
        body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return body


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path: Path, monkeypatch) -> BackendTarget:
    """The bucket: a file:// directory, or a bucket of a real S3-compatible server (moto)."""
    return make_backend_target(request.param, request, tmp_path, monkeypatch)


@pytest.fixture
def signed_store(daemon_factory, scratch: Path, store: BackendTarget):
    """Steps 1 and 2 of JOB saved by a signing daemon and drained to the store; the daemon is then
    killed (only the store is used afterwards)."""
    key = _key(scratch / "manifest.key", b"cluster")
    d = daemon_factory("n0", args=("--persistent", store.url, "--persist-every", "1", "--manifest-key-file", str(key)),
                       env=store.env)
    with d.client() as c:
        for step in (1, 2):
            c.save(JOB, step, 0, 1, {"w": np.full(1000, step, np.float32)},
                   metadata={"step": step}).wait("persistent", timeout=60)
    d.kill()
    return key, store


def _fresh(daemon_factory, store: BackendTarget, key: Path, name: str, *extra: str):
    return daemon_factory(name, args=("--persistent", store.url, "--manifest-key-file", str(key), *extra),
                          env=store.env)


def test_every_manifest_written_carries_a_mac(signed_store) -> None:
    _, store = signed_store
    with open_backend(store.url) as be:
        for step in (1, 2):
            doc = json.loads(be.get_bytes(_manifest_key(step)))
            assert len(doc["mac"]) == 64 and doc["step"] == step


def test_forged_and_edited_manifests_in_the_bucket_are_never_restored_nor_counted(signed_store, daemon_factory):
    key, store = signed_store
    with open_backend(store.url) as be:
        real = json.loads(be.get_bytes(_manifest_key(2)))
        be.put_bytes(_manifest_key(3), _body({**real, "step": 3}, b"attacker's own key" * 2))  # newer, own key
        be.put_bytes(_manifest_key(4), _body({**real, "step": 4}, None))  # a newer step, no MAC at all
        moved = {**real, "step": 5}
        be.put_bytes(_manifest_key(5), json.dumps(moved, separators=(",", ":"), sort_keys=True).encode())  # MAC moved
        edited = json.loads(be.get_bytes(_manifest_key(1)))
        edited["metadata_json"] = json.dumps({"step": 1, "lr": 1e9})  # metadata edited, MAC kept
        be.put_bytes(_manifest_key(1), json.dumps(edited, separators=(",", ":"), sort_keys=True).encode())

    d = _fresh(daemon_factory, store, key, "n1")
    with d.client() as c:
        assert c.latest(JOB) == 2
        complete = {i.step for i in c.list(JOB) if i.complete}
        assert complete == {2}, complete
        got = c.restore(JOB, 0)
        assert got.step == 2 and got.tier == "persistent" and got.metadata == {"step": 2}
        assert np.array_equal(np.frombuffer(got.shards["w"], np.float32), np.full(1000, 2, np.float32))
        for step in (1, 3, 4, 5):
            with pytest.raises((DataLossError, NotFoundError)):
                c.restore(JOB, 0, step=step)
        report = c.verify_job(JOB)
    bad = {(ch.step, ch.state) for ch in report.copies if ch.state != "ok"}
    assert bad == {(1, "mismatch"), (3, "mismatch"), (4, "mismatch"), (5, "mismatch")}, report
    details = {ch.step: ch.detail for ch in report.copies if ch.tier == "persistent"}
    assert "signature does not match" in details[1] and "not signed" in details[4], details


def test_accept_unsigned_reads_old_steps_and_verify_lists_them(daemon_factory, scratch: Path,
                                                              store: BackendTarget) -> None:
    """Steps written before signing was turned on: refused by default, read with the flag, and
    reported by verify as unsigned."""
    d = daemon_factory("old", args=("--persistent", store.url, "--persist-every", "1"), env=store.env)  # no key
    with d.client() as c:
        c.save(JOB, 1, 0, 1, {"w": b"written unsigned"}).wait("persistent", timeout=60)
    d.kill()
    with open_backend(store.url) as be:
        assert "mac" not in json.loads(be.get_bytes(_manifest_key(1)))
    key = _key(scratch / "manifest.key", b"cluster")

    strict = _fresh(daemon_factory, store, key, "strict")
    with strict.client() as c:
        assert c.latest(JOB) is None
        with pytest.raises((DataLossError, NotFoundError)):
            c.restore(JOB, 0, step=1)
    strict.kill()

    lenient = _fresh(daemon_factory, store, key, "lenient", "--accept-unsigned-manifests")
    with lenient.client() as c:
        assert c.latest(JOB) == 1
        assert bytes(c.restore(JOB, 0).shards["w"]) == b"written unsigned"
        report = c.verify_job(JOB)
    persistent = [ch for ch in report.copies if ch.tier == "persistent"]
    assert [(ch.step, ch.state) for ch in persistent] == [(1, "ok")], report
    assert "unsigned manifest" in persistent[0].detail, report


def test_a_manifest_edited_in_the_local_dir_is_quarantined_at_start(daemon_factory, scratch: Path) -> None:
    key = _key(scratch / "manifest.key", b"cluster")
    d = daemon_factory("n0", args=("--manifest-key-file", str(key)))
    with d.client() as c:
        c.save(JOB, 1, 0, 1, {"w": b"one"}, metadata={"ok": True}).result(30)
        c.save(JOB, 2, 0, 1, {"w": b"two"}, metadata={"ok": True}).result(30)
    d.kill()
    manifests = sorted(d.local_dir.rglob("manifest.json"))
    assert len(manifests) == 2
    newest = max(manifests, key=lambda p: json.loads(p.read_bytes())["step"])
    doc = json.loads(newest.read_bytes())
    doc["metadata_json"] = json.dumps({"ok": False})  # a trainer in the socket group edits it
    newest.write_bytes(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())
    d.start()
    with d.client() as c:
        assert c.latest(JOB) == 1
        got = c.restore(JOB, 0)
        assert got.step == 1 and got.metadata == {"ok": True}
    assert "signature does not match" in d.log_path.read_text()


def test_a_replica_signed_with_another_key_is_refused_on_receipt(daemon_factory, scratch: Path) -> None:
    """Two nodes with different manifest keys (a misconfigured or foreign node): n1 refuses n0's
    replicas, so n0's save never counts as held by a peer."""
    keys = {"n0": _key(scratch / "a.key", b"a"), "n1": _key(scratch / "b.key", b"b")}
    cl = Cluster(daemon_factory, 2, wait=False)
    for node in ("n0", "n1"):
        cl.d[node].kill()
        cl.d[node] = daemon_factory(node, port=cl.ports[node],
                                    args=(*cl.args, "--manifest-key-file", str(keys[node])))
    cl.wait_peers("n0")
    with cl.d["n0"].client() as c:
        fut = c.save(JOB, 1, 0, 1, {"w": b"replicate me"})
        fut.result(30)
        with pytest.raises(TierError, match="signature|signed|DataLoss|manifest"):
            fut.wait("peer", timeout=60)
    with cl.d["n1"].client() as c:
        assert "manifest_json: manifest signature does not match" in cl.d["n0"].log_path.read_text()
        assert not any(i.step == 1 and "local" in i.tiers for i in c.list(JOB))


@pytest.mark.parametrize("problem,mode,content", [
    ("readable by others", 0o644, b"k" * 40),
    ("needs at least 32", 0o600, b"short"),
])
def test_a_bad_key_file_stops_start_up_naming_the_key(scratch: Path, problem: str, mode: int, content: bytes) -> None:
    key = scratch / "bad.key"
    key.write_bytes(content)
    key.chmod(mode)
    p = run_daemon(scratch, "--manifest-key-file", str(key))
    assert p.returncode == 2, p.stderr
    assert "manifest_key_file" in p.stderr and problem in p.stderr, p.stderr


def test_the_daemon_warns_when_manifests_are_unsigned(daemon_factory) -> None:
    d = daemon_factory("n0")
    assert "manifests are not signed" in d.log_path.read_text()

