"""The XOR rebuild is pipelined: a protector answers ``OpenRebuiltChunk`` as soon as the decode's
sources are opened and serves the decoded bytes as they are written, so the restorer's pull
overlaps the decode. Checked here: the blob ticket of a file being written (served in order as
written, the end held back until the writer is done, a failed writer cuts the stream short with
no error reply the reader could take for data), the protector side answering before its decode
ends, and on real daemons a corrupt member that still never yields wrong bytes."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import tierckpt
from tierckpt.common import checksum as _checksum
from tierckptd.knobs import KNOBS
from tierckptd.parity import farside
from tierckptd.peer import bulk
from tierckptd.peer.blobs import HOLD_BACK, BlobTickets, Progress

from ..harness import Cluster
from .test_parity import PARITY, _save_all


def test_progress_serves_the_written_prefix_in_order_and_holds_back_the_end():
    size = HOLD_BACK + 3000
    p = Progress(size)
    p.wrote(1000, 1000)  # out of order: nothing contiguous yet
    with pytest.raises(tierckpt.UnavailableError, match="stalled"):
        p.wait_past(0, timeout=0.05)
    p.wrote(0, 1000)
    assert p.wait_past(0, timeout=1) == 2000
    p.wrote(2000, size - 2000)  # all written, but not finished: the end is held back
    assert p.wait_past(0, timeout=1) == size - HOLD_BACK
    with pytest.raises(tierckpt.UnavailableError):
        p.wait_past(size - HOLD_BACK, timeout=0.05)
    p.finish()
    assert p.wait_past(size - HOLD_BACK, timeout=1) == size


def test_progress_finished_short_or_failed_serves_nothing_more():
    p = Progress(100)
    p.wrote(0, 50)
    p.finish()  # a writer declaring a file complete that is not
    with pytest.raises(tierckpt.UnavailableError, match="50 of 100"):
        p.wait_past(0, timeout=1)
    q = Progress(100)
    q.fail("slot fails its checksum")
    with pytest.raises(tierckpt.UnavailableError, match="checksum"):
        q.wait_past(0, timeout=1)


def _serve_in_thread(tickets: BlobTickets, ticket: str, size: int) -> tuple[socket.socket, list[BaseException]]:
    """Serve one whole-blob "get" on one end of a socket pair; the reader's end is returned."""
    ours, theirs = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            tickets.serve(theirs, ticket, "slot", (0, size, size), bytearray(1 << 16), lambda s, n: None)
        except BaseException as e:  # asserted on by the test
            errors.append(e)
        finally:
            theirs.close()
    threading.Thread(target=serve, daemon=True).start()
    ours.settimeout(10)
    return ours, errors


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            break
        out += got
    return bytes(out)


def test_a_blob_being_written_is_served_as_it_is_written(tmp_path: Path):
    size = 3 * HOLD_BACK
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
    fd = os.open(tmp_path / "chunk", os.O_RDWR | os.O_CREAT)
    tickets = BlobTickets()
    progress = Progress(size)
    ticket = tickets.issue(os.dup(fd), size, "n1", progress)
    sock, errors = _serve_in_thread(tickets, ticket, size)
    with sock:
        assert bulk.recv_msg(sock) == {"ok": True, "length": size}  # answered before a byte is written
        os.pwrite(fd, data[:HOLD_BACK], 0)
        progress.wrote(0, HOLD_BACK)
        assert _recv_exactly(sock, HOLD_BACK) == data[:HOLD_BACK]  # served while the rest is not written
        os.pwrite(fd, data[HOLD_BACK:], HOLD_BACK)
        progress.wrote(HOLD_BACK, size - HOLD_BACK)
        assert _recv_exactly(sock, HOLD_BACK) == data[HOLD_BACK:2 * HOLD_BACK]
        progress.finish()  # the end only once the writer is done
        assert _recv_exactly(sock, HOLD_BACK) == data[2 * HOLD_BACK:]
    os.close(fd)
    assert not errors
    assert not tickets.holds(ticket)  # every byte served once: spent


def test_a_failed_writer_cuts_the_stream_short_without_an_error_reply(tmp_path: Path):
    size = 2 * HOLD_BACK
    fd = os.open(tmp_path / "chunk", os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"\x01" * size, 0)
    tickets = BlobTickets()
    progress = Progress(size)
    ticket = tickets.issue(os.dup(fd), size, "n1", progress)
    progress.wrote(0, size)
    sock, errors = _serve_in_thread(tickets, ticket, size)
    with sock:
        assert bulk.recv_msg(sock) == {"ok": True, "length": size}
        assert _recv_exactly(sock, size - HOLD_BACK) == b"\x01" * (size - HOLD_BACK)
        progress.fail("parity slot fails its checksum")
        assert _recv_exactly(sock, HOLD_BACK) == b""  # closed: no error reply, no held-back bytes
    os.close(fd)
    assert len(errors) == 1 and isinstance(errors[0], ConnectionAbortedError)  # an OSError: not answered


class _FakeDecode:
    """A decode whose progress the test drives: each ``step`` event lets one piece be written."""

    def __init__(self, write, pieces: list[bytes]) -> None:
        self.write, self.pieces = write, pieces
        self.steps = [asyncio.Event() for _ in pieces]
        self.closed = False

    async def run(self) -> int:
        at = 0
        for ev, piece in zip(self.steps, self.pieces):
            await ev.wait()
            self.write(at, piece)
            at += len(piece)
        return 123

    def close(self) -> None:
        self.closed = True


def test_the_protector_answers_before_its_decode_ends_and_serves_what_is_decoded(monkeypatch, tmp_path: Path):
    length = 2 * farside.WINDOW + HOLD_BACK
    data = np.random.default_rng(9).integers(0, 256, length, dtype=np.uint8).tobytes()
    pieces = [data[:farside.WINDOW], data[farside.WINDOW:]]
    made: list[_FakeDecode] = []

    async def open_chunk(pulls, protector, man, chunk, chunks, holder, opener, metrics=None, write=None, window=0):
        assert window == farside.WINDOW and holder == "n3"
        made.append(_FakeDecode(write, pieces))
        return made[-1]

    monkeypatch.setattr(farside, "open_chunk", open_chunk)
    man = types.SimpleNamespace(job="j", step=1, rank=2, nbytes=4 * length, key=("j", 1, 2))
    monkeypatch.setattr(farside.Manifest, "from_json", staticmethod(lambda s: man))
    member = types.SimpleNamespace(key=("n2", 2, "g", 0), manifest="{}", chunks=4, chunk=0)

    class PStore:
        def find(self, *a):
            return types.SimpleNamespace(members=[member])

        def incoming(self, job, step):
            return "in", os.open(tmp_path / "in", os.O_RDWR | os.O_CREAT)

        def discard(self, job, step, name):
            os.unlink(tmp_path / name)

    counted = []
    metrics = types.SimpleNamespace(parity_decode_bulk_bytes=types.SimpleNamespace(inc=counted.append))
    room = types.SimpleNamespace(usage=lambda: types.SimpleNamespace(free=1 << 40))  # a local tier with room
    far = farside.FarDecoder("n3", types.SimpleNamespace(pstore=PStore(), store=room), object, metrics)
    receiver = types.SimpleNamespace(blobs=BlobTickets(), bulk_port=1)
    req = types.SimpleNamespace(job="j", step=1, owner="n2", rank=2, generation="g", chunk=0, requester="n0")

    async def scenario() -> None:
        resp = await far.open(req, receiver)  # nothing decoded yet: answered all the same
        assert resp.size == length and receiver.blobs.holds(resp.ticket)
        assert not (tmp_path / "in").exists()  # the private file is unlinked at once (the fds keep it)
        sock, errors = _serve_in_thread(receiver.blobs, resp.ticket, length)
        loop = asyncio.get_running_loop()
        with sock:
            assert (await loop.run_in_executor(None, bulk.recv_msg, sock))["length"] == length
            made[0].steps[0].set()  # the first window decoded: served before the decode goes on
            got = await loop.run_in_executor(None, _recv_exactly, sock, farside.WINDOW)
            assert got == pieces[0] and not counted
            made[0].steps[1].set()
            rest = await loop.run_in_executor(None, _recv_exactly, sock, length - farside.WINDOW)
            assert rest == pieces[1]
        while far._tasks:
            await asyncio.sleep(0.01)
        assert not errors and counted == [123]
        assert far._decoding._value == farside.MAX_DECODES  # its place given back

    asyncio.run(scenario())


def test_a_decoded_chunk_stays_charged_until_its_file_is_gone(monkeypatch, tmp_path: Path):
    """The charge outlives the decode: the unlinked file takes room until its ticket was read (and
    the serve let go of it) or expired; then local_capacity gets it back, once."""
    length = farside.WINDOW + HOLD_BACK
    data = np.random.default_rng(3).integers(0, 256, length, dtype=np.uint8).tobytes()
    made: list[_FakeDecode] = []

    async def open_chunk(pulls, protector, man, chunk, chunks, holder, opener, metrics=None, write=None, window=0):
        made.append(_FakeDecode(write, [data]))
        return made[-1]

    monkeypatch.setattr(farside, "open_chunk", open_chunk)
    man = types.SimpleNamespace(job="j", step=1, rank=2, nbytes=4 * length, key=("j", 1, 2))
    monkeypatch.setattr(farside.Manifest, "from_json", staticmethod(lambda s: man))
    member = types.SimpleNamespace(key=("n2", 2, "g", 0), manifest="{}", chunks=4, chunk=0)
    files = iter(range(10))

    class PStore:
        def find(self, *a):
            return types.SimpleNamespace(members=[member])

        def incoming(self, job, step):
            name = f"in{next(files)}"
            return name, os.open(tmp_path / name, os.O_RDWR | os.O_CREAT)

        def discard(self, job, step, name):
            os.unlink(tmp_path / name)

    metrics = types.SimpleNamespace(parity_decode_bulk_bytes=types.SimpleNamespace(inc=lambda n: None))
    room = types.SimpleNamespace(usage=lambda: types.SimpleNamespace(free=1 << 40))
    far = farside.FarDecoder("n3", types.SimpleNamespace(pstore=PStore(), store=room), object, metrics)
    receiver = types.SimpleNamespace(blobs=BlobTickets(), bulk_port=1)
    req = types.SimpleNamespace(job="j", step=1, owner="n2", rank=2, generation="g", chunk=0, requester="n0")

    async def decoded(resp) -> None:
        made[-1].steps[0].set()
        while far._tasks:
            await asyncio.sleep(0.01)
        assert far.held >= length  # the decode is over, the file is not: still charged

    async def scenario() -> None:
        read = await far.open(req, receiver)
        await decoded(read)
        sock, errors = _serve_in_thread(receiver.blobs, read.ticket, length)
        loop = asyncio.get_running_loop()
        with sock:
            assert (await loop.run_in_executor(None, bulk.recv_msg, sock))["length"] == length
            assert await loop.run_in_executor(None, _recv_exactly, sock, length) == data
        for _ in range(200):
            if far.held == 0:
                break
            await asyncio.sleep(0.01)
        assert far.held == 0 and not errors  # read to the end and let go of: given back
        unread = await far.open(req, receiver)
        await decoded(unread)
        assert far.held == length
        with KNOBS.overridden(read_ticket_ttl=0.0):
            await asyncio.sleep(0.01)
            receiver.blobs.expire()
        assert far.held == 0 and not receiver.blobs.holds(unread.ticket)  # expired: given back, once
        receiver.blobs.close()
        assert far.held == 0

    asyncio.run(scenario())


def test_a_corrupt_member_never_yields_wrong_bytes_it_falls_back(daemon_factory, scratch: Path):
    """A member's chunk cannot be checked alone: the protector decodes wrong bytes and streams
    them, the restorer's check of the rebuilt rank against its manifest refuses them, and the
    restore goes on to the persistent tier."""
    bucket = scratch / "bucket"
    cl = Cluster(daemon_factory, 5, replicas=0, extra=(*PARITY, "--persistent", f"file://{bucket}",
                                                         "--persist-every", "1"))
    job, world = "parm", 5
    sums = _save_all(cl, job, 2, world, [3_000_000] * world, also="persistent")
    # flip a byte in the middle of every data file of n1's own rank (a member of every slot of n0's chunks)
    flipped = 0
    for f in (cl.d["n1"].local_dir / "jobs").rglob("*"):
        if f.is_file() and f.stat().st_size >= 1_000_000:
            buf = bytearray(f.read_bytes())
            buf[len(buf) // 2] ^= 0xFF
            f.write_bytes(bytes(buf))
            flipped += 1
    assert flipped >= 1
    cl.replace("n0")
    cl.wait_peers("n0")
    with cl.d["n0"].client() as c:
        ck = c.restore(job, 0, step=2)
        assert ck.tier == "persistent"
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[0]
    log = cl.d["n0"].log_text()
    assert "reconstructed from parity fails its checksum" in log or "fails its checksum" in log



def test_a_replaced_nodes_protector_pulls_give_way_to_its_restore_bounded():
    import time

    from tierckptd.parity.protector import Protector

    prot = Protector("n2", None, None, None, 5)
    state = {"restoring": 1}
    prot.restoring = lambda: state["restoring"]

    async def scenario() -> None:
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(prot._give_way(t0 + 30))
        await asyncio.sleep(0.3)
        assert not waiter.done()  # held while the restore runs
        state["restoring"] = 0
        await asyncio.wait_for(waiter, 2)
        state["restoring"] = 1
        t1 = time.monotonic()
        await prot._give_way(t1 + 0.2)  # the budget runs out: pulled regardless
        assert 0.15 <= time.monotonic() - t1 < 2

    asyncio.run(scenario())
