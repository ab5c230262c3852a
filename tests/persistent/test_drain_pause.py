"""Issue 28 item 3: the drain's chunk worker processes are stopped while a save is open or
committing on the node, continued when the last one leaves, never for longer than
``drain_yield`` at a time, and never left behind stopped by a daemon that is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tierckptd.knobs import KNOBS
from tierckptd.persistent.pause import DrainPause

from .rig import Rig
from .test_drain_quiet import CHUNK, _drain, _restored, _save, _shards


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fake(pids: list[int], limit: float = 2.0) -> tuple[DrainPause, _Clock, list[tuple[int, int]]]:
    """A pause on a fake clock that continues the workers the moment the last save leaves."""
    clock, sent = _Clock(), []
    pause = DrainPause(lambda: list(pids), limit=lambda: limit, clock=clock, kill=lambda p, s: sent.append((p, s)),
                       linger=lambda: 0.0)
    return pause, clock, sent


def test_a_save_stops_every_worker_and_its_end_continues_them() -> None:
    pause, _, sent = _fake([11, 12])
    pause.busy(True)
    assert sent == [(11, signal.SIGSTOP), (12, signal.SIGSTOP)] and pause.stopped == [11, 12]
    pause.busy(True)  # still busy: nothing sent twice
    assert len(sent) == 2
    pause.busy(False)
    assert sent[2:] == [(11, signal.SIGCONT), (12, signal.SIGCONT)] and pause.stopped == []
    pause.close()


def test_drain_yield_zero_never_pauses_and_a_vanished_worker_is_skipped() -> None:
    pause, _, sent = _fake([11], limit=0.0)
    pause.busy(True)
    pause.busy(False)
    assert sent == []

    def kill(pid: int, sig: int) -> None:
        if pid == 11:
            raise ProcessLookupError(pid)
        sent.append((pid, sig))

    pause = DrainPause(lambda: [11, 12], limit=lambda: 2.0, kill=kill, linger=lambda: 0.0)
    pause.busy(True)
    assert pause.stopped == [12]
    pause.busy(False)
    assert sent == [(12, signal.SIGSTOP), (12, signal.SIGCONT)]
    pause.close()


def test_the_drain_stays_stopped_a_moment_after_the_last_save_leaves() -> None:
    """drain_resume_delay: the commit's reply reaches the trainer, and a save that follows at once
    finds the workers still stopped (not continued and stopped again), before the drain runs."""
    sent: list[tuple[float, int, int]] = []
    pause = DrainPause(lambda: [21, 22], limit=lambda: 60.0, linger=lambda: 0.3,
                       kill=lambda p, s: sent.append((time.monotonic(), p, s)))
    pause.busy(True)
    t0 = time.monotonic()
    pause.busy(False)
    assert pause.paused and [s for _, _, s in sent] == [signal.SIGSTOP] * 2
    pause.busy(True)  # the next save, within the delay: the same pause goes on, nothing signalled
    pause.busy(False)
    time.sleep(0.15)
    assert pause.paused and len(sent) == 2
    _wait_for(lambda: not pause.paused)
    assert [(p, s) for _, p, s in sent[2:]] == [(21, signal.SIGCONT), (22, signal.SIGCONT)]
    assert sent[2][0] - t0 >= 0.3 and pause.stopped == [] and pause.pauses == 1
    pause.close()


def test_the_delay_after_the_last_save_stays_within_drain_yield() -> None:
    sent: list[int] = []
    pause = DrainPause(lambda: [31], limit=lambda: 0.2, linger=lambda: 30.0, kill=lambda p, s: sent.append(s))
    t0 = time.monotonic()
    pause.busy(True)
    pause.busy(False)
    _wait_for(lambda: not pause.paused)
    assert sent == [signal.SIGSTOP, signal.SIGCONT] and time.monotonic() - t0 < 5.0
    pause.close()


def test_closing_continues_workers_held_after_the_last_save() -> None:
    sent: list[int] = []
    pause = DrainPause(lambda: [41], limit=lambda: 60.0, linger=lambda: 30.0, kill=lambda p, s: sent.append(s))
    pause.busy(True)
    pause.busy(False)
    pause.close()
    assert sent == [signal.SIGSTOP, signal.SIGCONT] and not pause.paused


def _wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_a_save_left_open_pauses_the_drain_at_most_half_the_time() -> None:
    """A pause ends at drain_yield; the drain then runs as long before the next one (real time)."""
    sent: list[tuple[float, int]] = []
    pause = DrainPause(lambda: [7], limit=lambda: 0.2, kill=lambda p, s: sent.append((time.monotonic(), s)))
    pause.busy(True)
    _wait_for(lambda: len(sent) >= 4)  # stop, continue at the limit, stop again after the run
    pause.busy(False)
    pause.close()
    sigs = [s for _, s in sent]
    assert sigs[:4] == [signal.SIGSTOP, signal.SIGCONT, signal.SIGSTOP, signal.SIGCONT]
    stopped_for, ran_for = sent[1][0] - sent[0][0], sent[2][0] - sent[1][0]
    assert 0.15 <= stopped_for < 1.0 and ran_for >= 0.15
    assert pause.pauses >= 2


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_real_chunk_workers_stop_while_a_save_is_open_and_the_drain_then_completes(tmp_path: Path) -> None:
    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_processes=1, codec_threads=2, drain_yield=60.0):
            rig = Rig(tmp_path)
            await rig.tier.start()
            _save(rig, 1, _shards(1))
            await _drain(rig, 1)  # the children exist now
            pids = rig.tier.content.reader.workers.pids()
            assert pids and all(_state(p) != "T" for p in pids)
            trainer = rig.store.begin("other", 1, 0, 1, [("x", 16, "", ())])  # a save open on the node
            _wait_for(lambda: all(_state(p) == "T" for p in pids), 2.0)  # stopped at once, wherever they were
            sent = rig.tier.content.sent
            _save(rig, 2, _shards(2))  # committed meanwhile: the other save keeps the node busy
            await asyncio.sleep(0.5)
            assert all(_state(p) == "T" for p in pids)
            assert rig.tier.content.sent == sent  # nothing of step 2 went up
            rig.store.abort(trainer.save_id)
            _wait_for(lambda: all(_state(p) != "T" for p in pids), 2.0)
            await _drain(rig, 2)
            await _restored(rig, tmp_path, 2, _shards(2))
            await rig.tier.stop(1.0)

    asyncio.run(body())


_ORPHAN = textwrap.dedent("""
    import os, signal, sys, time
    from tierckptd.persistent.chunkproc import ChunkWorkers
    workers = ChunkWorkers()
    with workers.take(4096) as w:
        pass
    pid = workers.pids()[0]
    os.kill(pid, signal.SIGSTOP)
    print(pid, flush=True)
    time.sleep(600)
""")


def test_a_stopped_chunk_worker_dies_with_its_daemon() -> None:
    """A daemon killed while its children are stopped leaves none behind (a stopped child never
    sees its socket close): they die with the thread that started them."""
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, env=os.environ.copy())
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    _wait_for(lambda: _state(child) == "T")
    proc.kill()
    proc.wait(10)
    _wait_for(lambda: not Path(f"/proc/{child}").exists() or _state(child) == "Z", timeout=10)


@pytest.mark.parametrize("busy_first", [True, False])
def test_the_local_store_tells_its_listeners_when_saving_changes(tmp_path: Path, busy_first: bool) -> None:
    async def body() -> None:
        rig = Rig(tmp_path)
        await rig.tier.start()
        seen: list[bool] = []
        rig.store.watch_saving(seen.append)
        a = rig.store.begin("a", 1, 0, 1, [("x", 16, "", ())])
        b = rig.store.begin("b", 1, 0, 1, [("x", 16, "", ())])
        assert seen == [True]  # one change: a second open save changes nothing
        rig.store.abort((a if busy_first else b).save_id)
        assert seen == [True]
        rig.store.abort((b if busy_first else a).save_id)
        assert seen == [True, False]
        _save(rig, 1, _shards(1))  # begin ... commit: busy, then idle again
        assert seen == [True, False, True, False]
        await rig.tier.stop(1.0)

    asyncio.run(body())


def test_drain_threads_wait_while_paused_and_go_on_when_the_save_ends() -> None:
    pause = DrainPause(lambda: [], limit=lambda: 60.0)
    halt = threading.Event()
    done = threading.Event()

    def drain_thread() -> None:
        pause.wait_idle(halt)
        done.set()

    pause.wait_idle(halt)  # not paused: returns at once
    pause.busy(True)
    assert pause.paused
    t = threading.Thread(target=drain_thread)
    t.start()
    assert not done.wait(0.3)  # held while the save is open
    pause.busy(False)
    assert done.wait(2.0)  # woken when it ends
    t.join()
    pause.busy(True)
    t = threading.Thread(target=drain_thread)
    done.clear()
    t.start()
    halt.set()  # the tier stops: waiters go, woken at once (not by the second's backstop)
    pause.wake()
    assert done.wait(0.5)
    t.join()
    pause.close()


def test_a_paced_file_store_writes_exact_bytes_waiting_between_pieces(tmp_path: Path) -> None:
    from tierckptd.backends.file import FileBackend

    be = FileBackend(str(tmp_path / "store"))
    paces: list[int] = []
    be.pace = lambda: paces.append(1)
    data = os.urandom((3 << 20) + 12345)
    be.put_bytes("job/chunks/a", memoryview(data))
    # one wait before each 1 MiB piece, one before the file's fsync and one before its directory's
    assert be.get_bytes("job/chunks/a") == data and len(paces) == 4 + 2
    be.put_bytes("job/chunks/empty", b"")
    assert be.get_bytes("job/chunks/empty") == b""


def test_paused_seconds_count_every_pause_and_the_one_in_progress() -> None:
    pause, clock, _ = _fake([5], limit=60.0)
    pause.busy(True)
    clock.now += 3
    pause.busy(False)
    clock.now += 10  # running: not counted
    assert pause.paused_seconds() == 3
    pause.busy(True)
    clock.now += 1.5
    assert pause.paused_seconds() == 4.5
    pause.close()


def test_a_chunk_worker_stopped_by_a_pause_is_not_taken_for_starved(tmp_path: Path) -> None:
    """drain_idle_grace counts the time a child could have run: one stopped for a save is
    not lifted to the normal policy when its chunk takes longer than the grace."""
    from tierckptd.persistent.chunkproc import ChunkWorker

    data = np.random.default_rng(4).standard_normal(1 << 18).astype("<f4").tobytes()  # 1 MiB
    path = tmp_path / "shard"
    path.write_bytes(data)
    worker = ChunkWorker(len(data))
    stopped_at = [time.monotonic()]
    worker.paused_seconds = lambda: time.monotonic() - stopped_at[0]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.kill(worker.proc.pid, signal.SIGSTOP)
        stopped_at[0] = time.monotonic()

        def wake() -> None:
            time.sleep(3.0)
            held = time.monotonic() - stopped_at[0]
            worker.paused_seconds = lambda: held  # the pause ended: its length stays counted
            os.kill(worker.proc.pid, signal.SIGCONT)

        t = threading.Thread(target=wake)
        t.start()
        with KNOBS.overridden(drain_idle_grace=2.0):  # stopped for 3 s: past it, but not starved
            worker.hash(fd, 0, len(data), True, None, "shard")
        t.join()
        assert worker.lifts == 0 and not worker.lifted
    finally:
        os.close(fd)
        worker.close()


def test_a_stopped_tier_no_longer_listens_to_the_store(tmp_path: Path) -> None:
    async def body() -> None:
        rig = Rig(tmp_path)
        await rig.tier.start()
        assert rig.tier.content.reader.pause.busy in rig.store._saves.watch.listeners
        await rig.tier.stop(1.0)
        assert rig.store._saves.watch.listeners == []

    asyncio.run(body())
