"""Warm pages ahead of need (tierckptd.local.warm): pool files pre-allocated from the jobs' last saves,
within free capacity, dropped first; staging files of replicas and restores allocated ahead of
the writer."""

from __future__ import annotations

import itertools
import os
import time

import pytest
from tierckpt.common import checksum as _checksum
from tierckptd.knobs import KNOBS
from tierckptd.local.rules import charge_rank
from tierckptd.local.store import LocalStore
from tierckptd.local.warm import Warmer, fallocate_keep_size, free_pages_go_to_hypervisor, machine_headroom, touch_pages

from ..harness import wait_until
from ..threads import Checked

MIB = 1 << 20


def _save(store: LocalStore, job: str, step: int, data: dict[str, bytes], rank: int = 0, world: int = 1):
    st = store.begin(job, step, rank, world, [(n, len(b), "", ()) for n, b in data.items()])
    for n, b in data.items():
        with open(st.files[n].path, "r+b") as fh:
            fh.write(b)
    store.commit(st.save_id, {n: _checksum.digest(b) for n, b in data.items()})
    return st


def _wait(cond, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _settle(store: LocalStore) -> None:
    """Wait until the warming threads have nothing left to do (or wait for the node to be idle)."""
    wait_until(store.warm.warmer.idle, 60, "the warming threads idle", 0.02)


def _open(scratch, capacity: int, keep_local: int = 1) -> LocalStore:
    s = LocalStore(scratch / "data", "n0", capacity=capacity, keep_local=keep_local)
    s.open()
    return s


@pytest.fixture(autouse=True)
def fallocating():
    """These tests check fallocate's warming (nothing written) unless they ask for touching:
    the default (-1) depends on the machine (see test_touching_is_chosen_where_...)."""
    with KNOBS.overridden(warm_touch=0):
        yield


@pytest.fixture
def warm_on():
    with KNOBS.overridden(warm_pool=2, warm_ahead=2, warm_chunk=MIB):  # any filesystem; small steps
        yield


def test_the_second_save_of_a_job_takes_warm_files(scratch, warm_on):
    store = _open(scratch, 64 * MIB)
    try:
        _save(store, "j", 1, {"a": b"1" * (4 * MIB), "b": b"2" * (2 * MIB), "tiny": b"x"})
        assert _wait(lambda: store.usage().warm == 6 * MIB)  # tiny files are not warmed
        st = store.begin("j", 2, 0, 1, [("a", 4 * MIB, "", ()), ("b", 2 * MIB, "", ()), ("tiny", 1, "", ())])
        assert st.files["a"].recycled and st.files["b"].recycled and not st.files["tiny"].recycled
        # Never written: the client is told it is not faulted in (it writes it like a fresh file).
        assert st.files["a"].warm and st.files["b"].warm
        assert os.stat(st.files["a"].path).st_blocks * 512 >= 4 * MIB  # allocated before it was taken
        assert store.usage().warm == 0 and store.warm.counters()["warm_taken"] == 2
        store.abort(st.save_id)
    finally:
        store.close()


def test_warm_files_never_exceed_free_capacity(scratch, warm_on):
    step = charge_rank([4 * MIB])
    store = _open(scratch, step + 2 * MIB)  # one step fits, a second copy of its shard does not
    try:
        _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
        _settle(store)
        u = store.usage()
        assert u.warm == 0 and u.charged <= u.capacity
        assert store.warm.counters()["warmed_bytes"] == 0
    finally:
        store.close()


def test_warm_files_are_dropped_first_and_nothing_committed_is_evicted(scratch, warm_on):
    store = _open(scratch, charge_rank([4 * MIB]) * 2 + charge_rank([6 * MIB]) - MIB, keep_local=2)
    try:
        _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
        # keep_local 2: files for j's next two saves (nothing is recycled before its third commit).
        assert _wait(lambda: store.usage().warm == 8 * MIB)
        evicted = []
        store._on_evict = evicted.append
        # Another job needs 6 MiB: it fits only without the warm files, which go; j/1 stays.
        st = store.begin("k", 1, 0, 1, [("w", 6 * MIB, "", ())])
        assert not evicted and store.get("j", 1, 0) is not None
        u = store.usage()
        assert u.warm == 0 and u.charged <= u.capacity
        store.abort(st.save_id)
    finally:
        store.close()


def test_a_save_reuses_pooled_files_even_when_the_pool_must_shrink_for_it(scratch, warm_on):
    # Room for one step and the pool: the save takes its pooled file instead of dropping it to make room.
    store = _open(scratch, charge_rank([4 * MIB]) * 2 + MIB)
    try:
        _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
        assert _wait(lambda: store.usage().warm == 4 * MIB)
        st = store.begin("j", 2, 0, 1, [("a", 4 * MIB, "", ())])
        assert st.files["a"].recycled
        store.abort(st.save_id)
    finally:
        store.close()


def test_disabled_by_the_knobs(scratch):
    with KNOBS.overridden(warm_pool=0, warm_ahead=0):
        store = _open(scratch, 64 * MIB)
        try:
            _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
            st = store.begin("j", 2, 0, 1, [("a", 4 * MIB, "", ())], prefault=True)
            _settle(store)
            assert store.usage().warm == 0 and not st.files["a"].recycled
            assert store.warm.counters() == {"warm_taken": 0, "warmed_bytes": 0, "prefaulted_bytes": 0}
            assert os.stat(st.files["a"].path).st_blocks == 0  # nothing allocated ahead
        finally:
            store.close()


def test_an_inbound_copy_is_allocated_ahead_of_its_writer(scratch, warm_on):
    store = _open(scratch, 64 * MIB)
    try:
        st = store.begin("j", 1, 0, 1, [("a", 8 * MIB, "", ()), ("tiny", 100, "", ())], prefault=True)
        path = st.files["a"].path
        assert _wait(lambda: os.stat(path).st_blocks * 512 >= 8 * MIB)
        assert os.stat(path).st_size == 8 * MIB  # allocation never changes the size or the bytes
        with open(path, "rb") as fh:
            assert fh.read(4096) == bytes(4096)
        assert store.warm.counters()["prefaulted_bytes"] == 8 * MIB
        store.abort(st.save_id)
    finally:
        store.close()


def test_a_hinted_copy_is_warmed_within_free_capacity_once(scratch) -> None:
    with KNOBS.overridden(warm_hint=2, warm_chunk=MIB):
        store = _open(scratch, 20 * MIB)
        try:
            # Largest first, within free capacity; tiny shards are not warmed.
            assert store.warm.expect("j", 0, [8 * MIB, 16 * MIB, 1]) == 16 * MIB
            assert _wait(lambda: store.usage().warm == 16 * MIB)
            _settle(store)
            assert store.usage().warm == 16 * MIB  # served once: no second file for the same hint
            st = store.begin("j", 1, 0, 1, [("w", 16 * MIB, "", ())], prefault=True)
            assert st.files["w"].recycled and store.warm.counters()["warm_taken"] == 1
            store.abort(st.save_id)
            # A rank this node holds a step of recycles that step's files: no hint needed.
            _save(store, "k", 1, {"w": b"1" * (2 * MIB)})
            assert store.warm.expect("k", 0, [2 * MIB]) == 0
            assert store.warm.expect("k", 1, [2 * MIB]) == 2 * MIB
        finally:
            store.close()


def test_a_warm_file_taken_by_an_inbound_copy_is_only_finished_where_it_lacks_pages(scratch) -> None:
    """A fully warmed pool file costs its copy nothing more; a half-warmed one is finished from where
    the pool thread stopped, not walked again (on tmpfs SEEK_HOLE calls a fallocated, never written
    page a hole: walking it took the inode lock the receiver's writes need, once per chunk)."""
    with KNOBS.overridden(warm_hint=2, warm_ahead=2, warm_chunk=MIB):
        store = _open(scratch, 64 * MIB)
        try:
            assert store.warm.expect("j", 0, [16 * MIB]) == 16 * MIB
            assert _wait(lambda: store.warm.counters()["warmed_bytes"] == 16 * MIB)
            st = store.begin("j", 1, 0, 1, [("w", 16 * MIB, "", ())], prefault=True)
            assert st.files["w"].recycled
            _settle(store)
            assert store.warm.counters()["prefaulted_bytes"] == 0
            store.abort(st.save_id)
            # Half warmed (the pool thread stopped after 6 MiB): the other 10 MiB are allocated.
            fd = os.open(scratch / "half", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, 16 * MIB)
                fallocate_keep_size(fd, 0, 6 * MIB)
                store.warm.warmer.prefault(os.dup(fd), 16 * MIB)
                assert _wait(lambda: store.warm.counters()["prefaulted_bytes"] == 10 * MIB)
                assert os.fstat(fd).st_blocks * 512 == 16 * MIB
            finally:
                os.close(fd)
        finally:
            store.close()


def test_a_hinted_file_taken_before_it_is_warm_is_not_warmed_again(scratch) -> None:
    """The copy a hint announced can arrive before the pool thread has warmed its file (a 1 GiB
    file takes seconds to touch; the trainer's copy, which the hint races, a fraction of that):
    the copy takes the file as it is and its writer finishes it. The hint is then served: the
    pool must not warm a second file of that size, which nothing would take (the copy's next
    step recycles this one's files) and whose allocation would compete with the transfers."""
    with KNOBS.overridden(warm_hint=2, warm_ahead=2, warm_chunk=MIB, warm_idle_poll=30.0):
        store = _open(scratch, 64 * MIB)
        try:
            trainer = store.begin("other", 1, 0, 1, [("x", 2 * MIB, "", ())])  # busy: the pool thread holds
            assert store.warm.expect("j", 0, [16 * MIB]) == 16 * MIB
            assert _wait(lambda: store.usage().warm == 16 * MIB)  # the hinted file exists, not warmed yet
            copy = store.begin("j", 1, 0, 1, [("w", 16 * MIB, "", ())], prefault=True)
            assert copy.files["w"].recycled and store.warm.counters()["warm_taken"] == 1
            store.abort(trainer.save_id)
            _settle(store)
            assert store.usage().warm == 0  # no second file for the same hint
            assert store.warm.counters()["warmed_bytes"] == 0
            store.abort(copy.save_id)
            # A new hint for the same size is served again.
            assert store.warm.expect("j", 2, [16 * MIB]) == 16 * MIB
            assert _wait(lambda: store.warm.counters()["warmed_bytes"] == 16 * MIB)
            _settle(store)
            assert store.usage().warm == 16 * MIB
        finally:
            store.close()


def test_hints_are_ignored_when_off(scratch) -> None:
    with KNOBS.overridden(warm_hint=0):
        store = _open(scratch, 64 * MIB)
        try:
            assert store.warm.expect("j", 0, [8 * MIB]) == 0
            _settle(store)
            assert store.usage().warm == 0
        finally:
            store.close()


def test_pool_warming_waits_while_the_node_is_busy(scratch, warm_on) -> None:
    """Open saves (a trainer's, an inbound copy's) and peer transfers reading from the store hold
    the pool thread back; the end of the last one lets it go at once (not at the next poll)."""
    with KNOBS.overridden(warm_idle_poll=30.0):  # only a wake-up can let it go within the test
        store = _open(scratch, 64 * MIB)
        try:
            trainer = store.begin("other", 1, 0, 1, [("x", 2 * MIB, "", ())])  # a trainer still copying
            inbound = store.begin("peer-job", 1, 0, 1, [("y", 2 * MIB, "", ())], prefault=True)
            _save(store, "j", 1, {"a": b"1" * (4 * MIB)})  # the commit asks for a warm 4 MiB file
            with store.warm.sending():  # a replica being pushed from here
                # Not waits: windows in which a thread that ignored the busy node would allocate
                # (a loaded machine can make them miss such a bug, never fail a correct daemon).
                store.abort(trainer.save_id)
                time.sleep(0.2)
                store.abort(inbound.save_id)
                time.sleep(0.3)
                assert store.warm.counters()["warmed_bytes"] == 0  # created, but not one page allocated yet
            assert _wait(lambda: store.warm.counters()["warmed_bytes"] == 4 * MIB)
            assert store.usage().warm == 4 * MIB
        finally:
            store.close()


def test_warming_leaves_the_machines_reserve_alone_whatever_the_capacity_says(scratch, warm_on) -> None:
    """Several daemons (or other programs) may share the filesystem and the memory: the store's
    own free capacity is not enough to warm into."""
    fd = os.open(scratch, os.O_RDONLY)
    try:
        st = os.fstatvfs(fd)
        with KNOBS.overridden(warm_reserve=0.0):
            assert 0 < machine_headroom(fd, tmpfs=False) <= st.f_bavail * st.f_frsize
        with KNOBS.overridden(warm_reserve=1.0):
            assert machine_headroom(fd, tmpfs=True) == 0
    finally:
        os.close(fd)
    store = _open(scratch, 64 * MIB)
    try:
        with KNOBS.overridden(warm_reserve=1.0):  # nothing left to give: no pool file, no hint served
            _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
            _settle(store)
            assert store.usage().warm == 0 and store.warm.counters()["warmed_bytes"] == 0
            assert store.warm.expect("k", 0, [4 * MIB]) == 0
        _save(store, "m", 1, {"a": b"2" * (3 * MIB)})  # the reserve back to 20%: warmed again
        assert _wait(lambda: store.usage().warm == 7 * MIB)
    finally:
        store.close()


def test_the_pool_warms_for_every_save_before_the_job_starts_recycling(scratch, warm_on) -> None:
    """keep_local k: saves 2..k+1 all need new files (nothing is evicted before the job holds
    k + 1 steps), so after save 1 the pool holds files for k saves; after save k+1 the evicted
    step's files come back and nothing more is warmed."""
    store = _open(scratch, 64 * MIB, keep_local=3)
    try:
        _save(store, "j", 1, {"w": b"1" * (2 * MIB)})
        assert _wait(lambda: store.usage().warm == 6 * MIB)
        _settle(store)
        assert store.usage().warm == 6 * MIB  # 3 saves' worth, no more
        for step in (2, 3, 4):
            _save(store, "j", step, {"w": bytes([step]) * (2 * MIB)})
            _settle(store)
        assert store.warm.counters()["warm_taken"] == 3  # saves 2-4 each took a warm file
        assert store.complete_steps("j") == [2, 3, 4]
        u = store.usage()
        assert u.warm == 0 and u.recycle == 2 * MIB  # step 1's file, for save 5
    finally:
        store.close()


def _save_copy(store: LocalStore, job: str, step: int, data: dict[str, bytes], owner: str = "n9"):
    """Commit a copy of ``owner``'s rank 0 (what an inbound replica commits)."""
    st = store.begin(job, step, 0, 1, [(n, len(b), "", ()) for n, b in data.items()], prefault=True)
    for n, b in data.items():
        with open(st.files[n].path, "r+b") as fh:
            fh.write(b)
    store.commit(st.save_id, {n: _checksum.digest(b) for n, b in data.items()}, node=owner)


def test_the_pool_warms_for_copies_only_until_their_owner_drops_one(scratch, warm_on) -> None:
    """A rank held here as a copy gets its next copy's files from the copy its owner drops first
    (the owner evicts, drops, then pushes): with keep_local k, copies 2..k need new files, copy
    k+1 and later recycle. Measured before this rule (keep_local 1): every receiver touched a
    1 GiB pool file after its first copy (1.1-2.2 s of CPU at nice 19, during the next rounds'
    transfers), which nothing took and which held the memory until the pool's idle timeout."""
    store = _open(scratch, 64 * MIB, keep_local=1)
    try:
        _save_copy(store, "j", 1, {"w": b"1" * (2 * MIB)})
        _settle(store)
        assert store.usage().warm == 0 and store.warm.counters()["warmed_bytes"] == 0
        _save(store, "mine", 1, {"w": b"1" * (4 * MIB)})  # this node's own rank: its next save needs files
        assert _wait(lambda: store.usage().warm == 4 * MIB)
        _settle(store)
        assert store.usage().warm == 4 * MIB
    finally:
        store.close()
    store = _open(scratch / "k2", 64 * MIB, keep_local=2)
    try:
        _save_copy(store, "j", 1, {"w": b"1" * (2 * MIB)})
        assert _wait(lambda: store.usage().warm == 2 * MIB)  # copy 2 comes before any drop
        _settle(store)
        assert store.usage().warm == 2 * MIB
        _save_copy(store, "j", 2, {"w": b"2" * (2 * MIB)})
        _settle(store)
        assert store.warm.counters()["warm_taken"] == 1 and store.usage().warm == 0  # copy 3 recycles
    finally:
        store.close()


def test_no_pool_file_for_a_job_whose_save_is_open(scratch, warm_on) -> None:
    """A save in progress took its files; its commit evicts a step whose files return to the pool
    (keep_local 1), so nothing is warmed for the job until that commit asks again."""
    store = _open(scratch, 64 * MIB)
    try:
        with KNOBS.overridden(warm_pool=0):
            _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
        st = store.begin("j", 2, 0, 1, [("a", 4 * MIB, "", ())])
        _save(store, "other", 1, {"b": b"2" * (2 * MIB)})  # a commit elsewhere kicks the pool thread
        _settle(store)
        assert store.usage().warm == 2 * MIB  # for "other" only
        with open(st.files["a"].path, "r+b") as fh:
            fh.write(b"3" * (4 * MIB))
        store.commit(st.save_id, {"a": _checksum.digest(b"3" * (4 * MIB))})
        _settle(store)
        # Step 1's file came back to the pool (recycled, not warm): nothing more to warm for "j".
        assert store.usage().warm == 2 * MIB and store.warm.counters()["warmed_bytes"] == 2 * MIB
    finally:
        store.close()


def test_the_pool_does_not_warm_files_for_shards_the_last_save_shared(scratch, warm_on):
    store = _open(scratch, 64 * MIB, keep_local=3)
    try:
        with KNOBS.overridden(warm_pool=0):  # nothing warmed after step 1
            _save(store, "j", 1, {"frozen": b"f" * (4 * MIB), "w": b"1" * (2 * MIB)})
        base = store.get("j", 1, 0)
        assert base is not None
        st = store.begin("j", 2, 0, 1, [("frozen", 4 * MIB, "", ()), ("w", 2 * MIB, "", ())],
                         unchanged=["frozen"], base_step=1)
        assert st.files["frozen"].shared and not st.files["w"].shared
        with open(st.files["w"].path, "r+b") as fh:
            fh.write(b"2" * (2 * MIB))
        store.commit(st.save_id, {"frozen": base.shard("frozen").checksum, "w": _checksum.digest(b"2" * (2 * MIB))})
        assert _wait(lambda: store.usage().warm == 4 * MIB)
        _settle(store)
        # Files for the changed shard (keep_local 3, 2 steps held: the next two saves need new
        # files); none for the shared one (the next save will link it again).
        assert store.usage().warm == 4 * MIB
        assert sorted(os.path.getsize(p) for p in (scratch / "data" / "recycle").iterdir()) == [2 * MIB] * 2
    finally:
        store.close()


# -- touching pages (warm_touch=1, the default where a hypervisor takes free memory back)


def test_a_touched_pool_file_is_handed_out_as_faulted_in(scratch, warm_on):
    with KNOBS.overridden(warm_touch=1):
        store = _open(scratch, 64 * MIB)
        try:
            _save(store, "j", 1, {"a": b"1" * (4 * MIB)})
            assert _wait(lambda: store.usage().warm == 4 * MIB)
            _settle(store)
            st = store.begin("j", 2, 0, 1, [("a", 4 * MIB, "", ())])
            # Every page was written (zeroed): the client may write it through a map, like a recycled file.
            assert st.files["a"].recycled and not st.files["a"].warm
            assert os.stat(st.files["a"].path).st_blocks * 512 == 4 * MIB
            with open(st.files["a"].path, "rb") as fh:
                assert fh.read() == bytes(4 * MIB)
            assert store.warm.counters()["warm_taken"] == 1
            store.abort(st.save_id)
        finally:
            store.close()


def test_touching_never_changes_a_files_bytes_even_under_a_concurrent_writer(scratch):
    size = 32 * MIB
    data = os.urandom(size)
    fd = os.open(scratch / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, data[: 4 * MIB], 0)  # written before: only mapped, not zeroed
        fallocate_keep_size(fd, 4 * MIB, 4 * MIB)  # allocated, never written: zeroed, still zero
        def write() -> None:
            for off in range(8 * MIB, size, MIB):
                os.pwrite(fd, data[off:off + MIB], off)

        writer = Checked(write)
        writer.start()
        for off in range(0, size, MIB):  # touched while the writer writes the same range
            touch_pages(fd, off, MIB)
        writer.join(120)
        touch_pages(fd, 12345, 3 * MIB)  # any offset: the map starts at the page below
        assert os.pread(fd, size, 0) == data[: 4 * MIB] + bytes(4 * MIB) + data[8 * MIB:]
        assert os.fstat(fd).st_size == size and os.fstat(fd).st_blocks * 512 == size
    finally:
        os.close(fd)


def test_touching_pages_lets_other_threads_run(scratch):
    """Populating pages can take tens of milliseconds per chunk (a VM that hands free memory back
    to its host): it must not hold the GIL meanwhile, or every RPC of the daemon stalls behind
    the warmer (Python's own ``mmap.madvise`` holds it)."""
    size = 256 * MIB
    fd = os.open(scratch / "big", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        window: list[float] = []

        def touch() -> None:
            window.append(time.perf_counter())
            touch_pages(fd, 0, size)
            window.append(time.perf_counter())

        toucher = Checked(touch)
        ticks = [time.perf_counter()]
        toucher.start()
        while toucher.is_alive():
            time.sleep(0.001)
            ticks.append(time.perf_counter())
        toucher.join(120)
        assert os.fstat(fd).st_blocks * 512 == size
        start, end = window
        inside = [t for t in ticks if start < t < end]
        gaps = [b - a for a, b in itertools.pairwise(ticks) if b > start and a < end]
        # Held, the whole populate would be one gap with no tick inside it.
        assert len(inside) >= 3 and max(gaps) < 0.5 * (end - start), (end - start, max(gaps), len(inside))
    finally:
        os.close(fd)


def test_touching_falls_back_to_fallocate_where_the_kernel_cannot(scratch, monkeypatch):
    import errno

    from tierckptd.local import warm

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(warm, "touch_pages", unsupported)
    fd = os.open(scratch / "f", os.O_RDWR | os.O_CREAT, 0o600)
    files = [(os.dup(fd), "f", 4 * MIB)]
    w = Warmer(lambda: files.pop() if files else None, lambda name: True, touch=lambda: True)
    try:
        os.ftruncate(fd, 4 * MIB)
        with KNOBS.overridden(warm_chunk=MIB):
            w.kick()
            assert _wait(lambda: w.warmed == 4 * MIB)
        assert w.touch_failed and os.fstat(fd).st_blocks * 512 == 4 * MIB
    finally:
        w.stop()
        os.close(fd)


def test_a_file_is_never_touched_just_ahead_of_its_writer(scratch, monkeypatch):
    """Prefault ahead of an inbound copy's writer fallocates even where pool files are touched
    (both faulting the same file's pages in was measured slower)."""
    from tierckptd.local import warm

    touched = []
    monkeypatch.setattr(warm, "touch_pages", lambda fd, off, n: touched.append(off))
    w = Warmer(lambda: None, lambda name: False, touch=lambda: True)
    fd = os.open(scratch / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 4 * MIB)
        with KNOBS.overridden(warm_chunk=MIB):
            w.prefault(os.dup(fd), 4 * MIB)
            assert _wait(lambda: w.prefaulted == 4 * MIB)
        assert not touched and os.fstat(fd).st_blocks * 512 == 4 * MIB
    finally:
        w.stop()
        os.close(fd)


def test_touching_is_chosen_where_the_kernel_reports_free_pages_to_a_hypervisor(tmp_path):
    """virtio-balloon's feature bit 5 (VIRTIO_BALLOON_F_REPORTING), read from sysfs."""
    def balloon(features: str | None):
        d = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        if features is not None:
            (d / "virtio0").mkdir()
            (d / "virtio0" / "features").write_text(features + "\n")
        return str(d)

    probe = free_pages_go_to_hypervisor.__wrapped__
    assert probe(balloon("0110010100" + "0" * 54))
    assert not probe(balloon("0110000100" + "0" * 54))
    assert not probe(balloon(None))  # a balloon driver without a device
    assert not probe(str(tmp_path / "missing"))  # no balloon driver at all
