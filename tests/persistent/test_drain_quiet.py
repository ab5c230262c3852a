"""Issue 28 item 3: the drain stays out of a save's way. Its threads run under SCHED_IDLE and are
kept between calls, its chunk work runs in SCHED_IDLE child processes that are kept between drains
(or, without them, in reused chunk buffers), and a drain that yields to an open save resumes and
completes once the save ends. Behaviour only: no timing is asserted."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from tierckpt.errors import DataLossError
from tierckptd.knobs import KNOBS
from tierckptd.persistent.calls import DaemonThreads

from .rig import Rig

CHUNK = 4096


def _shards(seed: int, n: int = 3, chunks: int = 3) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"s{i}": (rng.standard_normal(chunks * CHUNK // 4) * 0.02).astype(np.float32).tobytes() for i in range(n)}


async def _drain(rig: Rig, step: int) -> None:
    await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 30)


def _save(rig: Rig, step: int, shards: dict[str, bytes]) -> None:
    rig.save("job", step, 0, shards, dtypes={k: "<f4" for k in shards})


async def _restored(rig: Rig, root: Path, step: int, want: dict[str, bytes]) -> None:
    reader = Rig(root, node_id=f"reader{step}-{len(list(root.iterdir()))}", memory=rig.memory)
    await reader.tier.start()
    local = await reader.tier.fetch("job", step, 0)
    assert {s: reader.store.shard_path(local, s).read_bytes() for s in want} == want
    await reader.tier.stop(1.0)


def test_drain_threads_run_under_sched_idle_and_are_kept(tmp_path: Path) -> None:
    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_processes=0, drain_idle=1):
            rig = Rig(tmp_path)
            await rig.tier.start()
            rig.faulty.hang("put_bytes")  # the drain's first upload (its lease) waits on a drain thread
            _save(rig, 1, _shards(1))
            assert await asyncio.to_thread(rig.faulty.wait_held, "put_bytes", 10)
            drains = [t for t in threading.enumerate() if t.name == "tierckpt-drain"]
            assert drains and all(os.sched_getscheduler(t.native_id) == os.SCHED_IDLE for t in drains)
            rig.faulty.release("put_bytes")
            await _drain(rig, 1)
            await _restored(rig, tmp_path, 1, _shards(1))
            await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_waiting_thread_takes_the_next_call_of_its_own_policy_only() -> None:
    pool = DaemonThreads("t", lambda: policy[0], keep=30.0)
    policy = [(0, False)]
    first = pool.submit(threading.get_native_id).result(5)
    assert pool.submit(threading.get_native_id).result(5) == first  # kept, not a new thread
    policy[0] = (0, True)
    idle = pool.submit(lambda: (threading.get_native_id(), os.sched_getscheduler(0))).result(5)
    assert idle[0] != first and idle[1] == os.SCHED_IDLE  # another policy: another thread
    policy[0] = (0, False)
    assert pool.submit(threading.get_native_id).result(5) == first
    assert pool.active == 0


def test_a_drain_call_starved_under_sched_idle_finishes_lifted_and_its_thread_goes_back() -> None:
    """On a node whose cores stay busy a SCHED_IDLE drain thread gets almost no CPU: a call still
    running after ``drain_idle_grace`` finishes at the normal policy (at its niceness), and the
    thread drops back under SCHED_IDLE for its next call; with a grace of 0 nothing is lifted."""
    import time

    pool = DaemonThreads("t", lambda: (19, True), keep=30.0, lift=True)
    assert pool.lifter is not None
    lifts = pool.lifter.lifts

    def call(seconds: float) -> tuple[int, int, int, int]:
        before = os.sched_getscheduler(0)
        time.sleep(seconds)
        return threading.get_native_id(), before, os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)

    with KNOBS.overridden(drain_idle_grace=0.05):
        tid, before, after, nice = pool.submit(call, 0.5).result(10)
        assert (before, after, nice) == (os.SCHED_IDLE, os.SCHED_OTHER, 19)  # lifted during the call
        assert pool.lifter.lifts == lifts + 1
        deadline = time.monotonic() + 5
        while os.sched_getscheduler(tid) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE  # back, parked for the next call
        assert pool.submit(call, 0.0).result(10)[:3] == (tid, os.SCHED_IDLE, os.SCHED_IDLE)  # quick: not lifted
    with KNOBS.overridden(drain_idle_grace=0):  # 0: never lifted
        assert pool.submit(call, 0.3).result(10)[1:3] == (os.SCHED_IDLE, os.SCHED_IDLE)
    assert pool.lifter.lifts == lifts + 1 and pool.active == 0


def test_a_drain_thread_that_cannot_be_lifted_says_so_once_and_waits(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Where the kernel refuses the lift (no ``RLIMIT_NICE``), the call still finishes, under
    SCHED_IDLE; the refusal is logged once and no later call is watched."""
    import logging
    import time

    from tierckptd.persistent.calls import Lifter

    pool = DaemonThreads("t", lambda: (19, True), keep=30.0)
    pool.lifter = lifter = Lifter()  # its own: the process's one is shared by the other tests
    real = os.sched_setscheduler

    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        if policy != os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")
        real(pid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", refuse)

    def call() -> int:
        time.sleep(0.3)
        return os.sched_getscheduler(0)

    with KNOBS.overridden(drain_idle_grace=0.05), caplog.at_level(logging.WARNING, "tierckptd.persistent.calls"):
        assert pool.submit(call).result(10) == os.SCHED_IDLE
        assert not lifter.can_lift and lifter.lifts == 0
        assert pool.submit(call).result(10) == os.SCHED_IDLE
    said = [r.getMessage() for r in caplog.records if "cannot be lifted" in r.getMessage()]
    assert len(said) == 1 and "RLIMIT_NICE" in said[0], said


@pytest.mark.parametrize("drain_idle", [1, 0])
def test_chunk_workers_are_sched_idle_processes_kept_between_drains(tmp_path: Path, drain_idle: int) -> None:
    """Every thread of a child is at SCHED_IDLE and nice 19, the one numpy's imports start too,
    even where the drain thread that started the child is not (``drain_idle = 0``)."""
    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_processes=1, codec_threads=2, drain_idle=drain_idle):
            rig = Rig(tmp_path)
            await rig.tier.start()
            _save(rig, 1, _shards(1))
            await _drain(rig, 1)
            pids = rig.tier.content.reader.workers.pids()
            assert 1 <= len(pids) <= 2
            for pid in pids:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
                assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids), pid
                assert all(os.getpriority(os.PRIO_PROCESS, t) == 19 for t in tids), pid
            _save(rig, 2, _shards(2))
            await _drain(rig, 2)
            assert rig.tier.content.reader.workers.pids() == pids  # the same children: none started again
            os.kill(pids[0], 9)  # a child that dies between drains is replaced
            await asyncio.to_thread(lambda: os.waitpid(pids[0], 0))
            _save(rig, 3, _shards(3))
            await _drain(rig, 3)
            assert pids[0] not in rig.tier.content.reader.workers.pids()
            for step in (1, 2, 3):
                await _restored(rig, tmp_path, step, _shards(step))
            await rig.tier.stop(1.0)
            assert rig.tier.content.reader.workers.pids() == []  # ended with the tier

    asyncio.run(body())


def test_a_changed_local_copy_is_found_by_the_chunk_workers(tmp_path: Path) -> None:
    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_processes=1):
            rig = Rig(tmp_path)
            man = rig.save("job", 1, 0, _shards(1), persist=False, dtypes={k: "<f4" for k in _shards(1)})
            path = rig.store.shard_path(man, "s1")
            data = bytearray(path.read_bytes())
            data[5000] ^= 1
            path.write_bytes(bytes(data))
            content = rig.tier.content
            with pytest.raises(DataLossError, match="checksum"):
                await asyncio.to_thread(content.reader.hash_shard, man, "s1")
            assert len(await asyncio.to_thread(content.reader.hash_shard, man, "s0")) == 3
            content.reader.workers.close()

    asyncio.run(body())


@pytest.mark.parametrize("processes", [0, 1])
def test_a_drain_yielding_to_an_open_save_resumes_and_completes(tmp_path: Path, processes: int) -> None:
    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_yield=60.0, drain_processes=processes):
            rig = Rig(tmp_path)
            await rig.tier.start()
            trainer = rig.store.begin("other", 1, 0, 1, [("x", 16, "", ())])  # a save open on the node
            _save(rig, 1, _shards(1))
            await asyncio.sleep(0.5)
            assert rig.tier.content.sent == 0  # nothing hashed nor encoded while it is open
            rig.store.abort(trainer.save_id)
            await _drain(rig, 1)
            assert rig.tier.content.sent > 0
            await _restored(rig, tmp_path, 1, _shards(1))
            await rig.tier.stop(1.0)

    asyncio.run(body())


def test_chunk_buffers_are_reused_and_bounded_by_the_codec_slots(tmp_path: Path) -> None:
    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_processes=0, codec_threads=2):
            rig = Rig(tmp_path)
            await rig.tier.start()
            for step in (1, 2):
                _save(rig, step, _shards(step, n=4, chunks=3))  # 12 chunks, hashed and encoded
                await _drain(rig, step)
                assert 1 <= rig.tier.content.reader.buffers.created <= 2 * step  # one per slot and drain at most
                assert rig.tier.content.reader.buffers.idle() == 0  # unmapped once no drain is in flight
            await _restored(rig, tmp_path, 2, _shards(2, n=4, chunks=3))
            await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_node_that_cannot_start_chunk_workers_drains_on_its_threads(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckptd.persistent import chunkproc

    def refused(self: object, size: int) -> None:
        raise PermissionError("memfd_create: refused by the sandbox")

    monkeypatch.setattr(chunkproc.ChunkWorker, "__init__", refused)

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_processes=1):
            rig = Rig(tmp_path)
            await rig.tier.start()
            _save(rig, 1, _shards(1))
            await _drain(rig, 1)  # at once: no failed attempt to retry later
            assert rig.tier.content.reader.workers.failed and rig.tier.content.reader.workers.pids() == []
            await _restored(rig, tmp_path, 1, _shards(1))
            await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_starved_chunk_worker_is_lifted_for_its_chunk_and_put_back_at_sched_idle(tmp_path: Path) -> None:
    """On a node whose cores stay busy a SCHED_IDLE child gets almost no CPU: past
    ``drain_idle_grace`` it finishes its chunk at the normal policy, then drops back."""
    from tierckptd.persistent.chunkproc import ChunkWorker

    data = np.random.default_rng(3).standard_normal(1 << 21).astype("<f4").tobytes()  # 8 MiB
    path = tmp_path / "shard"
    path.write_bytes(data)
    worker = ChunkWorker(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        with KNOBS.overridden(drain_idle_grace=1e-4):  # no 8 MiB chunk is hashed in 0.1 ms: always lifted
            digest = worker.hash(fd, 0, len(data), True, None, "shard")
        assert worker.lifts == 1 and not worker.lifted
        assert os.sched_getscheduler(worker.proc.pid) == os.SCHED_IDLE  # back for the next chunk
        with KNOBS.overridden(drain_idle_grace=0):  # 0: never lifted
            assert worker.hash(fd, 0, len(data), True, None, "shard") == digest
        assert worker.lifts == 1
    finally:
        os.close(fd)
        worker.close()


def test_a_chunk_worker_taken_by_a_sched_idle_thread_on_a_busy_node_starts_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain thread that first needs a child runs at ``SCHED_IDLE``: a child started from it
    inherited that, and on a node whose every core is busy its interpreter got almost no CPU (the
    start timed out after 60 s and the drain fell back to its threads). Children are started by a
    thread the tier starts as it is built; a child drops to ``SCHED_IDLE`` once it is ready."""
    import subprocess
    import sys
    import time

    from tierckptd.persistent import chunkproc

    monkeypatch.setattr(chunkproc, "_SPAWNER", [])  # a fresh spawner, as in a new daemon
    workers = chunkproc.ChunkWorkers()  # built here, on a thread at the normal policy, like the tier
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    got: dict[str, object] = {}

    def drain_thread() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only, like a drain thread
        t0 = time.monotonic()
        try:
            with workers.take(1 << 20) as w:
                got["pid"] = w.proc.pid
        except OSError as err:
            got["error"] = err
        got["seconds"] = time.monotonic() - t0

    try:
        time.sleep(0.5)  # the burners are running
        t = threading.Thread(target=drain_thread)
        t.start()
        t.join(90)
        assert "pid" in got and got["seconds"] < 10, got  # 60 s (the start-up timeout) before
        pid = got["pid"]
        assert isinstance(pid, int)
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(pid) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.05)  # (it lowers itself right after saying it is ready)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, pid) == 19
    finally:
        for b in burners:
            b.kill()
            b.wait()
        workers.close()
