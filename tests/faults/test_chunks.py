"""The fault matrix on the content layout's own objects (the default ``persistent_layout``):
damaged, truncated, extended or deleted chunks shared by two steps, broken manifests, kill -9
while chunks are uploaded, and a collection killed mid-sweep. Each asserts that no wrong byte is
ever returned, that damage is a typed DataLossError (counted), and what repairs it."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import tierckpt
from tierckptd.persistent.layout import chunk_keys, manifest_key
from tierckptd.testing import free_port

from ..harness import wait_until
from ._util import Checker, flip_bit, payload, stored_files, stored_manifest, stored_objects
from .test_matrix import checksum_failures, knobs

JOB = "cx"
FROZEN = payload(JOB, 0, 0, "frozen", 300_000)  # the same bytes in every step: one chunk, shared


def _shards(step: int) -> dict[str, bytes]:
    return {"frozen": FROZEN, "head": payload(JOB, step, 0, "head", 5_000)}


def _restores(chk: Checker, c: tierckpt.Client, step: int) -> bool:
    """Restore ``step``: True when byte for byte; a typed error counts as lost, a wrong byte fails."""
    chk.matrix.record(committed=1)
    try:
        ck = c.restore(JOB, rank=0, step=step)
    except tierckpt.DataLossError:
        chk.matrix.record(lost=1, typed=1)
        return False
    got = {n: bytes(ck.shards[n]) for n in ck.shards}
    if got != _shards(step):
        chk.matrix.record(corrupt_returned=1)
        raise AssertionError(f"step {step} restored with wrong bytes")
    return True


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":
        flip_bit(path, len(data) // 2)
    elif how == "truncate":
        path.write_bytes(data[:-7])
    elif how == "extend":
        path.write_bytes(data + b"\0" * 7)
    else:
        path.unlink()


def _fresh(d) -> None:
    d.kill()
    d.wipe()  # no local copy: restores come from the object store
    d.start()


@pytest.mark.parametrize("how", ["flip", "truncate", "extend", "delete"])
def test_a_damaged_chunk_shared_by_two_steps_is_data_loss_until_a_drain_stores_it_again(
        daemon_factory, tmp_path: Path, matrix, how: str) -> None:
    """n0 drains; n1 (no peer tier, same store) restores. The damage is found by n1; n0's next
    drain of the same bytes stores the chunk again (it learns of the damage from n1's notice)."""
    chk, store, mport = Checker(matrix), tmp_path / "store", free_port()
    args = ("--persistent", f"file://{store}", "--persist-every", "1", "--keep-local", "1")
    writer = daemon_factory("n0", args=(*args, knobs()))
    reader = daemon_factory("n1", args=(*args, "--metrics-port", str(mport), knobs()))
    with writer.client() as c:
        for step in (1, 2):
            c.save(JOB, step, 0, 1, _shards(step)).wait("persistent", timeout=60)
    shared = stored_objects(store, JOB, 1, 0, "frozen")
    assert len(shared) == 1 and shared == stored_objects(store, JOB, 2, 0, "frozen")
    _damage(shared[0], how)
    with reader.client() as c:
        for step in (1, 2):  # every step naming the chunk: DataLoss, never a wrong byte
            chk.expect_error(lambda s=step: c.restore(JOB, rank=0, step=s), tierckpt.DataLossError)
        assert c.status().jobs == []  # nothing half-restored was committed
    assert checksum_failures(mport, "persistent") >= 2
    assert len(stored_files(store, "/damaged/")) == (0 if how == "delete" else 1)
    with writer.client() as c:  # a new step holding the same bytes stores the chunk again: both steps are back
        c.save(JOB, 3, 0, 1, _shards(3)).wait("persistent", timeout=60)
    assert stored_files(store, "/damaged/") == []
    with reader.client() as c:
        for step in (1, 2, 3):
            assert _restores(chk, c, step)


def test_broken_manifests_are_data_loss_and_other_steps_restore(daemon_factory, tmp_path: Path, matrix) -> None:
    chk, store = Checker(matrix), tmp_path / "store"
    d = daemon_factory("n0", args=("--persistent", f"file://{store}", "--persist-every", "1", knobs()))
    with d.client() as c:
        for step in (1, 2, 3, 4):
            c.save(JOB, step, 0, 1, {"a": payload(JOB, step, 0, "a", 4096),
                                     "b": payload(JOB, step, 0, "b", 4096)}).wait("persistent", timeout=60)
    path, _ = stored_manifest(store, JOB, 1, 0)
    path.write_bytes(path.read_bytes()[:40])  # truncated
    path, _ = stored_manifest(store, JOB, 2, 0)
    doc = json.loads(path.read_bytes())
    a, b = doc["shards"]
    a["chunks"], b["chunks"] = b["chunks"], a["chunks"]  # valid chunks, each in the other shard's place
    path.write_text(json.dumps(doc))
    path, _ = stored_manifest(store, JOB, 3, 0)
    doc = json.loads(path.read_bytes())
    doc["shards"][0]["chunks"][0][0] = "0" * 32  # names a chunk that does not exist
    path.write_text(json.dumps(doc))
    _fresh(d)
    with d.client() as c:
        for step in (1, 2, 3):
            chk.expect_error(lambda s=step: c.restore(JOB, rank=0, step=s), tierckpt.DataLossError)
        ck = c.restore(JOB, rank=0, step=4)
        assert bytes(ck.shards["a"]) == payload(JOB, 4, 0, "a", 4096)
        assert bytes(ck.shards["b"]) == payload(JOB, 4, 0, "b", 4096)
        assert {i.step for i in c.list(JOB) if "local" in i.tiers} == {4}


def test_kill9_while_chunks_are_uploaded_resumes_and_restores(daemon_factory, tmp_path: Path, matrix) -> None:
    chk, store = Checker(matrix), tmp_path / "store"
    args = ("--persistent", f"file://{store}", "--persist-every", "1")
    big = {"frozen": FROZEN, "head": random.Random(5).randbytes(4 << 20)}  # 64 distinct chunks
    d = daemon_factory("n0", args=(*args, knobs("chunk_bytes=65536", "debug_manifest_delay=60")))  # until the kill
    with d.client() as c:
        c.save(JOB, 1, 0, 1, big).result(60)
        wait_until(lambda: stored_files(store, "/content/"), 60, "a first chunk stored")
        d.kill()  # chunks partly up, the manifest not: nothing is visible as a step
    assert stored_files(store, "/manifests/") == [] and stored_files(store, "/leases/")
    d.args = (*args, knobs("chunk_bytes=65536"))
    d.start()  # the drain resumes from the durable queue; chunks already stored are not sent again
    with d.client() as c:
        wait_until(lambda: stored_files(store, "/manifests/"), 60, "the resumed drain")
    _, man = stored_manifest(store, JOB, 1, 0)
    named = {k for s in man.shards for k in chunk_keys(JOB, s)}
    assert len(named) > 50 and named <= {str(p.relative_to(store)) for p in stored_files(store, "/content/")}
    _fresh(d)
    with d.client() as c:
        ck = c.restore(JOB, rank=0, step=1)
        chk.matrix.record(committed=1)
        assert {n: bytes(ck.shards[n]) for n in ck.shards} == big


def test_a_collection_killed_mid_sweep_loses_nothing_and_does_not_hold_drains_up(
        daemon_factory, tmp_path: Path, matrix) -> None:
    """What a collector killed mid-sweep leaves (its marker, step 1's manifest and part of its
    chunks deleted) delays no drain of the restarted node, and the next collection finishes it."""
    chk, store = Checker(matrix), tmp_path / "store"
    args = ("--persistent", f"file://{store}", "--persist-every", "1", "--keep-persistent", "2")
    d = daemon_factory("n0", args=(*args, knobs()))
    with d.client() as c:
        for step in (1, 2):
            c.save(JOB, step, 0, 1, _shards(step)).wait("persistent", timeout=60)
    only_1 = set(stored_objects(store, JOB, 1, 0)) - set(stored_objects(store, JOB, 2, 0))
    assert len(only_1) == 1
    d.kill()
    marker = store / JOB / "gc" / f"{int(time.time() * 1000) - 500:013d}-0badc0ffee00-n0"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_bytes(b"")
    (store / manifest_key(JOB, 1, 0, 1)).unlink()  # swept so far: the manifest, not yet its chunk
    d.start()
    with d.client() as c:
        c.save(JOB, 3, 0, 1, _shards(3)).wait("persistent", timeout=90)  # not 2 x gc_window (120 s)
        assert not marker.exists()
        c.save(JOB, 4, 0, 1, _shards(4)).wait("persistent", timeout=30)  # retention: step 2 goes, then a sweep
    named = {p for s in (3, 4) for p in stored_objects(store, JOB, s, 0)}
    wait_until(lambda: set(stored_files(store, "/content/")) == named and not stored_files(store, "/gc/"), 60,
               "the next collection, its marker removed")
    _fresh(d)
    with d.client() as c:
        for step in (3, 4):
            assert _restores(chk, c, step)
        chk.expect_error(lambda: c.restore(JOB, rank=0, step=1), tierckpt.NotFoundError)
