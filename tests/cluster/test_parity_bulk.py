"""Reconstruction from parity moves its blocks over the bulk data channel (as replica fetches
do), decoding as they arrive: observed on real daemons through the
``tierckpt_parity_rebuild_bulk_bytes_total`` counter of the restoring node (each chunk
decoded on a protector, ``tierckpt_parity_decode_bulk_bytes_total`` there, and received once); plus the pieces a
hostile or confused peer meets (the window accumulator, slot tickets served once)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tierckpt
from tierckpt.common import checksum as _checksum
from tierckptd.parity.bulkdecode import W, Windows
from tierckptd.peer.blobs import BlobTickets

from ..harness import Cluster
from ..metrics_scrape import scrape

BULK = "tierckpt_parity_rebuild_bulk_bytes_total"
DECODE = "tierckpt_parity_decode_bulk_bytes_total"


def _save(cl: Cluster, job: str, step: int, sizes: list[int]) -> dict[int, dict[str, str]]:
    sums, clients, futs = {}, [], []
    try:
        for rank, size in enumerate(sizes):
            node = cl.ids[rank % len(cl.ids)]
            c = cl.d[node].client()
            clients.append(c)
            rng = np.random.default_rng(rank + 7 * step)
            a, b = rng.integers(0, 255, size, dtype=np.uint8), rng.integers(0, 255, 333 + rank, dtype=np.uint8)
            sums[rank] = {"a": _checksum.digest(a), "b": _checksum.digest(b)}
            futs.append(c.save(job, step, rank, len(sizes), {"a": a, "b": b}))
        for f in futs:
            f.wait("peer", timeout=120)
    finally:
        for c in clients:
            c.close()
    return sums


@pytest.mark.parametrize("redundancy,nodes", [("parity:4+1", 5), ("parity:4+2", 6)])
def test_a_lost_rank_is_rebuilt_over_the_bulk_channel(daemon_factory, redundancy, nodes):
    cl = Cluster(daemon_factory, nodes, replicas=0, extra=("--redundancy", redundancy), metrics=True)
    job = "bulkrb"
    sizes = [9_000_000 + 4_099 * r for r in range(nodes)]  # chunks over 2 MiB: several windows each
    sums = _save(cl, job, 3, sizes)
    victim = "n2"
    cl.replace(victim)
    cl.wait_peers(victim)
    port = cl.d[victim].info["metrics_port"]
    assert scrape(port).get(BULK, 0.0) == 0.0
    with cl.d[victim].client() as c:
        ck = c.restore(job, 2, step=3)
        assert ck.tier == "peer"
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[2]
    moved = scrape(port)[BULK]
    rank_bytes = sizes[2] + 333 + 2
    # each chunk decoded on a protector (XOR: its slot's; Reed-Solomon: a row holder of its lane)
    # and received once: the rank's bytes, not four times them
    assert 0.99 * rank_bytes <= moved <= 1.05 * rank_bytes, (moved, rank_bytes)
    pulled = sum(scrape(cl.d[n].info["metrics_port"]).get(DECODE, 0.0) for n in cl.ids if n != victim)
    # the protectors pulled the other three blocks of each chunk (or read them locally)
    assert pulled >= 0.9 * rank_bytes, pulled
    assert scrape(port).get(DECODE, 0.0) == 0.0
    log = cl.d[victim].log_text()
    assert f"reconstructed {job} step 3 rank 2 from parity" in log
    assert "bulk rebuild failed" not in log and "bulk pull failed" not in log
    assert "could not decode it for us" not in log
    for rank in range(nodes):  # every rank restores exactly (the others from their owners)
        with cl.d[victim].client() as c:
            ck = c.restore(job, rank, step=3)
            assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[rank]


def test_windows_xor_sources_of_unequal_length_in_any_order():
    length = 2 * W + 1000
    rng = np.random.default_rng(5)
    srcs = [rng.integers(0, 255, n, dtype=np.uint8).tobytes() for n in (length, W + 7, 2 * W + 1000, 10)]
    out = bytearray(length)

    def write(at: int, data) -> None:
        out[at:at + len(data)] = data

    win = Windows(length, [len(s) for s in srcs], write)
    order = [(i, w) for w in range(3) for i in (3, 1, 0, 2)]
    for i, w in order:
        piece = srcs[i][w * W:(w + 1) * W]
        if piece:
            win.add(w, memoryview(piece))
    win.check()
    want = np.zeros(length, dtype=np.uint8)
    for s in srcs:
        want[:len(s)] ^= np.frombuffer(s, dtype=np.uint8)
    assert bytes(out) == want.tobytes()
    with pytest.raises(tierckpt.DataLossError):
        win.add(3, memoryview(b"x"))  # past the chunk: a peer sending more than asked


def test_windows_incomplete_is_refused():
    win = Windows(W + 5, [W + 5, W + 5], lambda at, data: None)
    win.add(0, memoryview(bytes(W)))
    win.add(0, memoryview(bytes(W)))
    win.add(1, memoryview(bytes(5)))
    with pytest.raises(tierckpt.UnavailableError):
        win.check()


def test_slot_ticket_serves_each_byte_once_and_only_its_shard(tmp_path):
    path = tmp_path / "slot.bin"
    path.write_bytes(b"x" * 100)
    tickets = BlobTickets()
    t = tickets.issue(os.open(path, os.O_RDONLY), 100, "n1")
    assert tickets.describe(t) == (100, "n1")
    with pytest.raises(tierckpt.InvalidArgumentError):
        tickets.take(t, "a", [(0, 100)])
    fd, who = tickets.take(t, "slot", [(0, 50)])
    os.close(fd)
    assert who == "n1"
    with pytest.raises(tierckpt.FailedPreconditionError):
        tickets.take(t, "slot", [(10, 20)])  # served already
    fd, _ = tickets.take(t, "slot", [(50, 50)])
    os.close(fd)
    assert not tickets.holds(t)  # every byte served: spent, its file closed
    with pytest.raises(tierckpt.FailedPreconditionError):
        tickets.take(t, "slot", [(0, 1)])


class _Counter:
    def __init__(self) -> None:
        self.n = 0.0

    def inc(self, n: float = 1.0) -> None:
        self.n += n


def _rebuilder(monkeypatch, far_error: Exception | None):
    """A Rebuilder whose two bulk paths are stand-ins: which one a chunk takes, and what it counts."""
    import asyncio
    import types

    from tierckptd.parity import rebuild

    calls: list[str] = []

    async def far(pulls, man, chunk, chunks, holder, opener):
        calls.append(f"far:{holder}")
        if far_error is not None:
            raise far_error
        return 100

    async def here(pulls, protector, man, chunk, chunks, holder, opener, metrics=None):
        assert not pulls.failed  # a fresh set of connections, not the one the failed attempt cut
        calls.append(f"here:{holder}")
        return 400

    monkeypatch.setattr(rebuild, "pull_rebuilt", far)
    monkeypatch.setattr(rebuild, "pull_chunk", here)
    metrics = types.SimpleNamespace(parity_rebuild_bulk_bytes=_Counter())
    rb = rebuild.Rebuilder("n0", None, None, 5, None, None, metrics, transfer=object())
    man = types.SimpleNamespace(job="j", step=1, rank=2)

    def run(holder: str) -> None:
        asyncio.run(rb._chunk(man, 0, 4, holder, None))
    return rb, calls, metrics.parity_rebuild_bulk_bytes, run


def test_chunk_is_decoded_by_its_protector_first(monkeypatch):
    _, calls, moved, run = _rebuilder(monkeypatch, None)
    run("n3")
    assert calls == ["far:n3"] and moved.n == 100
    run("n0")  # the slot is here: decoded here (nothing to ask another node)
    assert calls == ["far:n3", "here:n0"] and moved.n == 500


@pytest.mark.parametrize("err", [tierckpt.FailedPreconditionError("UNIMPLEMENTED: an older daemon"),
                                 tierckpt.UnavailableError("a member's owner is down")])
def test_an_older_protector_gives_its_slot_and_the_chunk_is_decoded_here(monkeypatch, err):
    _, calls, moved, run = _rebuilder(monkeypatch, err)
    run("n3")
    assert calls == ["far:n3", "here:n3"] and moved.n == 400


def test_a_corrupt_slot_on_the_protector_is_not_retried_here(monkeypatch):
    _, calls, moved, run = _rebuilder(monkeypatch, tierckpt.DataLossError("slot fails its checksum"))
    with pytest.raises(tierckpt.DataLossError):
        run("n3")
    assert calls == ["far:n3"] and moved.n == 0
