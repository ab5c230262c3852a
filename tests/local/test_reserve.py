"""The reserve (``local_reserve``, tierckptd.local.reserve): pre-touched memory held from start-up,
handed to new staging files of any size, charged as used, refilled from evicted files, kept or
cleaned at restart, never through a symlink."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest
from tierckpt.common import checksum as _checksum
from tierckptd.config import ConfigError
from tierckptd.knobs import KNOBS
from tierckptd.local.rules import charge_file
from tierckptd.local.store import LocalStore

from ..harness import wait_until

MIB = 1 << 20


@pytest.fixture(autouse=True)
def small_extents():
    with KNOBS.overridden(reserve_extent=4 * MIB, warm_chunk=MIB):
        yield


def _open(root, reserve: int, capacity: int = 256 * MIB, keep_local: int = 1) -> LocalStore:
    s = LocalStore(root, "n0", capacity=capacity, keep_local=keep_local, reserve=reserve)
    s.open()
    wait_until(s.reserve.idle, 60, "the reserve filled", 0.02)
    return s


def _save(store: LocalStore, step: int, data: dict[str, bytes], job: str = "j"):
    st = store.begin(job, step, 0, 1, [(n, len(b), "", ()) for n, b in data.items()])
    for n, b in data.items():
        with open(st.files[n].path, "r+b") as fh:
            fh.write(b)
    store.commit(st.save_id, {n: _checksum.digest(b) for n, b in data.items()})
    return st


def _reserve_files(root) -> dict[str, int]:
    d = root / "reserve"
    return {p.name: p.stat().st_size for p in d.iterdir()}


def test_the_reserve_is_filled_at_start_up_and_counted_as_used(scratch):
    s = _open(scratch / "d", 16 * MIB)
    try:
        u = s.usage()
        assert u.reserve == u.reserve_ready == u.reserve_target == 16 * MIB
        assert u.reserve_charged == 4 * charge_file(4 * MIB) and u.charged == u.reserve_charged
        assert u.free == u.capacity - u.reserve_charged
        files = _reserve_files(scratch / "d")
        assert sorted(files.values()) == [4 * MIB] * 4
        for name in files:  # every page allocated (touched on tmpfs) before a save comes
            assert os.stat(scratch / "d" / "reserve" / name).st_blocks * 512 >= 4 * MIB
    finally:
        s.close()


def test_shards_of_any_size_take_the_reserve_before_new_memory(scratch):
    s = _open(scratch / "d", 16 * MIB)
    try:
        before = set(_reserve_files(scratch / "d"))
        inodes = {os.stat(scratch / "d" / "reserve" / n).st_ino for n in before}
        # 3 MiB fits a 4 MiB file whole (truncated); 6 MiB takes the largest file extended and
        # frees one more; 64 KiB is covered by a freed file.
        st = s.begin("j", 1, 0, 1, [("a", 3 * MIB, "", ()), ("b", 6 * MIB, "", ()), ("c", 64 << 10, "", ())])
        files = st.files
        assert files["a"].reserved and not files["b"].reserved and not files["c"].reserved
        assert os.stat(files["a"].path).st_size == 3 * MIB and os.stat(files["b"].path).st_size == 6 * MIB
        assert os.stat(files["a"].path).st_ino in inodes and os.stat(files["b"].path).st_ino in inodes
        assert os.stat(files["a"].path).st_mode & 0o777 == 0o660  # the socket group writes staging files
        u = s.usage()
        assert u.reserve_taken == 3 * MIB + 6 * MIB + (64 << 10)
        # 3 of the 4 files went: a's, b's, and one freed for b's rest and for c.
        assert u.reserve == 4 * MIB and len(_reserve_files(scratch / "d")) == 1
        data = {"a": b"a" * (3 * MIB), "b": b"b" * (6 * MIB), "c": b"c" * (64 << 10)}
        for n, b in data.items():
            with open(files[n].path, "r+b") as fh:
                fh.write(b)
        man, _ = s.commit(st.save_id, {n: _checksum.digest(b) for n, b in data.items()})
        for n, b in data.items():  # exactly the bytes written: a reserve file's old pages never show
            with open(s.shard_path(man, n), "rb") as fh:
                assert fh.read() == b
    finally:
        s.close()


def test_a_save_that_the_reserve_covers_fits_in_the_capacity_it_holds(scratch):
    # Capacity = the reserve and a manifest: a save of the reserve's size still fits (it takes it).
    s = _open(scratch / "d", 8 * MIB, capacity=2 * charge_file(4 * MIB) + 8 * charge_file(0))
    try:
        _save(s, 1, {"a": b"1" * (4 * MIB), "b": b"2" * (4 * MIB)})
        u = s.usage()
        assert u.reserve_taken == 8 * MIB and u.charged <= u.capacity
    finally:
        s.close()


def test_evicted_files_refill_the_reserve_then_the_recycle_pool(scratch):
    s = _open(scratch / "d", 4 * MIB, keep_local=1)
    try:
        s.reserve.stop()  # no touching refill here: only the evicted files
        st = _save(s, 1, {"a": b"1" * (4 * MIB), "b": b"2" * (4 * MIB)})
        assert sum(f.reserved for f in st.files.values()) == 1 and s.usage().reserve == 0
        _save(s, 2, {"a": b"3" * (4 * MIB), "b": b"4" * (4 * MIB)})  # evicts step 1: one file refills, one recycles
        u = s.usage()
        assert u.reserve == 4 * MIB and s.reserve.adopted_bytes == 4 * MIB and u.recycle == 4 * MIB
        st = s.begin("j", 3, 0, 1, [("a", 4 * MIB, "", ()), ("b", 4 * MIB, "", ())])
        assert sorted((f.recycled, f.reserved) for f in st.files.values()) == [(False, True), (True, False)]
        s.abort(st.save_id)
    finally:
        s.close()


def test_the_refill_waits_while_a_peer_transfer_reads_from_the_store(scratch):
    """A commit kicks the refill, and the same commit starts that step's replication, which reads
    the step's files from here: touching pages then (1-2 s of CPU per GiB in a VM) competed with
    the transfer (replication round 1 took 5.6 s instead of 2 s with a reserve). The refill waits
    like pool warming does, and the end of the transfer lets it go at once (not at the next poll)."""
    with KNOBS.overridden(warm_idle_poll=30.0):  # only a wake-up can let it go within the test
        s = _open(scratch / "d", 8 * MIB)
        try:
            before = s.reserve.touched_bytes
            with s.warm.sending():  # the step's replication, pushed from here
                _save(s, 1, {"a": b"1" * (4 * MIB)})  # takes a reserve file; the commit kicks the refill
                # Not a wait: a window in which a refill that ignored the transfer would touch
                # (a loaded machine can make it miss such a bug, never fail a correct daemon).
                time.sleep(0.3)
                assert s.reserve.touched_bytes == before and s.usage().reserve_ready == 4 * MIB
            wait_until(lambda: s.usage().reserve_ready == 8 * MIB, 20, "the reserve refilled", 0.02)
            assert s.reserve.touched_bytes == before + 4 * MIB
        finally:
            s.close()


def test_restart_keeps_reserve_files_and_removes_anything_else(scratch):
    root = scratch / "d"
    s = _open(root, 8 * MIB)
    kept = _reserve_files(root)
    s.close()
    outside = scratch / "outside"
    outside.write_bytes(b"precious")
    rdir = root / "reserve"
    (rdir / "123.0123456789ab").symlink_to(outside)  # a link under a reserve name
    (rdir / "999.0123456789ab").write_bytes(b"short")  # size does not match its name
    (rdir / "junk").write_bytes(b"x")
    os.mkdir(rdir / "sub")
    s = _open(root, 8 * MIB)
    try:
        assert _reserve_files(root) == kept  # the same files (pages kept), nothing else
        assert outside.read_bytes() == b"precious"
        assert s.usage().reserve_ready == 8 * MIB
    finally:
        s.close()
    s = _open(root, 0)  # the reserve turned off: its files go
    try:
        assert not _reserve_files(root) and s.usage().reserve == 0
    finally:
        s.close()


def test_a_reserve_larger_than_the_capacity_is_a_config_error(scratch):
    s = LocalStore(scratch / "d", "n0", capacity=4 * MIB, reserve=8 * MIB)
    with pytest.raises(ConfigError, match="local_reserve"):
        s.open()
    s.close()


def test_a_reserve_larger_than_a_default_capacity_is_halved_not_fatal(scratch, caplog):
    """The shipped configs set a reserve and leave local_capacity at its default (90% of the file
    system): a smaller local dir holds half its capacity instead of refusing to start."""
    s = LocalStore(scratch / "d", "n0", reserve=1 << 60)
    try:
        s.open()
        assert s.reserve.target == s.capacity // 2
        assert "local_reserve" in caplog.text
    finally:
        s.close()


def test_a_daemon_with_a_reserve_saves_into_it(daemon_factory):
    from tierckptd.testing import free_port

    from ..metrics_scrape import scrape

    port = free_port()
    d = daemon_factory(args=("--local-reserve", "24MiB", "--keep-local", "2", "--knobs", f"reserve_extent={4 * MIB}",
                             "--metrics-port", str(port)))
    state = {f"w{i}": np.full(MIB, i, dtype=np.float32) for i in range(2)}  # 2 x 4 MiB
    with d.client() as c:
        wait_until(lambda: c.status().reserve_ready_bytes == 24 * MIB, 60, "the reserve filled", 0.05)
        st = c.status()
        assert st.reserve_target_bytes == 24 * MIB and st.reserve_bytes >= 24 * MIB
        assert st.used_bytes >= st.reserve_bytes
        for step in (1, 2, 3):
            c.save("job", step, 0, 1, state).result(30)
        st = c.status()
        assert st.reserve_taken_bytes == 3 * 8 * MIB  # every save of the series took the reserve
        m = scrape(port)
        assert m["tierckpt_local_reserve_taken_bytes"] == 3 * 8 * MIB
        assert 0 < m["tierckpt_local_reserve_bytes"] <= m["tierckpt_local_used_bytes"]
        ck = c.restore("job", 0, step=3)
        assert all(np.array_equal(ck.shards[k], v) for k, v in state.items())
        ck.close()
    from tests.harness import _BIN_DIR

    p = subprocess.run([str(_BIN_DIR / "tierckpt"), "--address", d.address, "status", "--json"],
                       capture_output=True, text=True, timeout=30)
    local = json.loads(p.stdout)["local_tier"]
    assert local["reserve_target_bytes"] == 24 * MIB and local["reserve_taken_bytes"] == 24 * MIB
    p = subprocess.run([str(_BIN_DIR / "tierckpt"), "--address", d.address, "status"],
                       capture_output=True, text=True, timeout=30)
    assert ", reserve " in p.stdout and " of 24.0 MiB)" in p.stdout, p.stdout


def test_bad_local_reserve_is_one_line_naming_the_field(scratch):
    from tests.harness import _BIN_DIR

    for args in (["--local-reserve", "lots"], ["--local-reserve", "2GiB", "--local-capacity", "1GiB"],
                 ["--local-reserve", "-1"]):
        p = subprocess.run([str(_BIN_DIR / "tierckptd"), "--local-dir", str(scratch / "d"), *args],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "local_reserve" in lines[0], p.stderr


def test_replicas_take_the_receivers_reserve_and_a_restart_keeps_it(daemon_factory):
    from ..harness import Cluster

    reserve = ("--local-reserve", "16MiB", "--knobs", f"reserve_extent={4 * MIB}")
    cl = Cluster(daemon_factory, 2, extra=reserve)
    state = {"w": np.arange(MIB, dtype=np.float32)}  # one 4 MiB shard
    with cl.d["n0"].client() as c0, cl.d["n1"].client() as c1:
        for c in (c0, c1):
            wait_until(lambda c=c: c.status().reserve_ready_bytes == 16 * MIB, 60, "the reserve filled", 0.05)
        fut = c0.save("job", 1, 0, 1, state)
        fut.result(30)
        holders = fut.wait("peer", timeout=60)
        receiver = c1 if holders == ["n1"] else c0
        assert receiver.status().reserve_taken_bytes >= 4 * MIB  # the replica's staging file came from it
        # Refilled in the background once idle.
        wait_until(lambda: receiver.status().reserve_ready_bytes == 16 * MIB, 60, "the reserve refilled", 0.05)
    n1 = cl.d["n1"]
    with n1.client() as c:
        wait_until(lambda: c.status().reserve_ready_bytes == 16 * MIB, 60, "the reserve full", 0.05)
    files = {p.name for p in (n1.local_dir / "reserve").iterdir()}
    n1.terminate()
    n1.start()
    with n1.client() as c:
        wait_until(lambda: c.status().reserve_ready_bytes == 16 * MIB, 60, "the reserve kept", 0.05)
        # The files it found are kept (their pages stay resident), none added.
        assert {p.name for p in (n1.local_dir / "reserve").iterdir()} == files
        assert c.status().reserve_taken_bytes == 0  # a new daemon's counter
