"""Reed-Solomon (``parity:4+2``) restores decoded on the survivors, real daemons on loopback: each
lost chunk is decoded by a row holder of its lane (``OpenRebuiltChunk``, :mod:`tierckptd.parity.rsfar`)
and pulled once by the restorer, so the restorer's ``tierckpt_parity_rebuild_bulk_bytes_total`` is
about the rank's bytes (it was K times them when it decoded every chunk itself); one or two nodes
lost, every rank byte-exact; a corrupt row on a decoding survivor never yields wrong bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tierckpt.common import checksum as _checksum

from ..harness import Cluster
from ..metrics_scrape import scrape

RS = ("--redundancy", "parity:4+2")
BULK = "tierckpt_parity_rebuild_bulk_bytes_total"
DECODE = "tierckpt_parity_decode_bulk_bytes_total"
FELL_BACK = "could not decode it for us"


def _save(cl: Cluster, job: str, step: int, sizes: list[int], also: str = "") -> dict[int, dict[str, str]]:
    sums: dict[int, dict[str, str]] = {}
    clients, futs = [], []
    try:
        for rank, size in enumerate(sizes):
            c = cl.d[cl.ids[rank % len(cl.ids)]].client()
            clients.append(c)
            rng = np.random.default_rng(rank + 31 * step)
            a, b = rng.integers(0, 255, size, dtype=np.uint8), rng.integers(0, 255, 333 + rank, dtype=np.uint8)
            sums[rank] = {"a": _checksum.digest(a), "b": _checksum.digest(b)}
            futs.append(c.save(job, step, rank, len(sizes), {"a": a, "b": b}))
        for f in futs:
            f.wait("peer", timeout=120)
            if also:
                f.wait(also, timeout=120)
    finally:
        for c in clients:
            c.close()
    return sums


def _restored(c, job: str, rank: int, step: int, sums) -> str:
    ck = c.restore(job, rank, step=step)
    assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[rank], rank
    return ck.tier


def _metric(cl: Cluster, node: str, name: str) -> float:
    return scrape(cl.d[node].info["metrics_port"]).get(name, 0.0)


def test_one_node_lost_each_chunk_decoded_on_a_survivor_and_received_once(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS, metrics=True)
    job = "rsfar1"
    sizes = [6_000_000 + 4_099 * r for r in range(6)]  # chunks of ~1.5 MB: two decode windows each
    sums = _save(cl, job, 2, sizes)
    cl.replace("n2")
    cl.wait_peers("n2")
    with cl.d["n2"].client() as c:
        assert _restored(c, job, 2, 2, sums) == "peer"
    rank_bytes = sizes[2] + 333 + 2
    moved = _metric(cl, "n2", BULK)
    assert 0.99 * rank_bytes <= moved <= 1.05 * rank_bytes, (moved, rank_bytes)  # not 4x
    decoded = {n: _metric(cl, n, DECODE) for n in cl.ids if n != "n2"}
    # per chunk, the decoding survivor pulled the blocks of the lane it does not hold (three)
    assert sum(decoded.values()) >= 2 * rank_bytes, decoded
    assert sum(1 for v in decoded.values() if v) >= 2, decoded  # spread over several survivors' links
    assert _metric(cl, "n2", DECODE) == 0.0
    log = cl.d["n2"].log_text()
    assert f"reconstructed {job} step 2 rank 2 from parity" in log
    assert FELL_BACK not in log
    for n in decoded:  # decoded as the blocks arrived (tierckptd.parity.rsstream), not solved at the end
        assert "cannot be decoded as it arrives" not in cl.d[n].log_text(), n
    for rank in range(6):
        with cl.d["n2"].client() as c:
            assert _restored(c, job, rank, 2, sums) in ("local", "peer")


def test_two_nodes_lost_every_rank_restored_exactly_receiving_each_once(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS, metrics=True)
    job = "rsfar2"
    sizes = [2_500_000 + 7_919 * r for r in range(12)]  # two ranks per node: two lanes per stripe
    sums = _save(cl, job, 5, sizes)
    for victim in ("n1", "n4"):
        cl.replace(victim)  # kill -9 and wipe
    for victim in ("n1", "n4"):
        cl.wait_peers(victim)
    lost = {"n1": (1, 7), "n4": (4, 10)}
    for node, ranks in lost.items():
        with cl.d[node].client() as c:
            for rank in ranks:
                assert _restored(c, job, rank, 5, sums) == "peer"
        want = sum(sizes[r] + 333 + r for r in ranks)
        moved = _metric(cl, node, BULK)
        assert 0.99 * want <= moved <= 1.05 * want, (node, moved, want)
        assert FELL_BACK not in cl.d[node].log_text()
    for node in ("n1", "n4"):
        with cl.d[node].client() as c:
            for rank in range(12):
                assert _restored(c, job, rank, 5, sums) in ("local", "peer")


def _corrupt_rows_of(cl: Cluster, owner: str, nodes: list[str]) -> list[str]:
    """Flip a byte of every parity row on ``nodes`` that holds a chunk of ``owner``; their holders."""
    hit = []
    for n in nodes:
        for meta in sorted((cl.d[n].local_dir / "parity-rs").rglob("row-*.json")):
            if any(m["node"] == owner for m in json.loads(meta.read_text())["members"]):
                data = meta.with_suffix(".bin")
                buf = bytearray(data.read_bytes())
                buf[len(buf) // 3] ^= 0x5A
                data.write_bytes(bytes(buf))
                hit.append(n)
    return sorted(set(hit))


@pytest.mark.parametrize("where", ["one", "all"])
def test_a_corrupt_row_on_a_decoding_survivor_never_yields_wrong_bytes(daemon_factory, scratch: Path, where):
    """``one``: one survivor's rows of the lost node's chunks are corrupt; a spare row decodes them
    (there or on the restorer). ``all``: every row is; no decode succeeds anywhere, and the
    restore comes from the persistent tier, as when the restorer decoded everything."""
    bucket = scratch / "bucket"
    cl = Cluster(daemon_factory, 6, replicas=0, extra=(*RS, "--persistent", f"file://{bucket}",
                                                        "--persist-every", "1"), metrics=True)
    job = "rsfarc"
    sums = _save(cl, job, 4, [1_500_000 + 1_000 * r for r in range(6)], also="persistent")
    survivors = [n for n in cl.ids if n != "n0"]
    hit = _corrupt_rows_of(cl, "n0", survivors[:1] if where == "one" else survivors)
    if where == "one" and not hit:
        hit = _corrupt_rows_of(cl, "n0", survivors[1:2])
    assert hit
    cl.replace("n0")
    cl.wait_peers("n0")
    with cl.d["n0"].client() as c:
        tier = _restored(c, job, 0, 4, sums)
    assert tier == ("peer" if where == "one" else "persistent")
    assert any("fails its checksum" in cl.d[n].log_text() for n in [*hit, "n0"])


class _Counter:
    def __init__(self) -> None:
        self.n = 0.0

    def inc(self, n: float) -> None:
        self.n += n


@pytest.mark.parametrize("err", [None, "FailedPreconditionError", "UnavailableError", "DataLossError"])
def test_a_chunk_a_survivor_cannot_decode_is_decoded_here(monkeypatch, err):
    """An older row holder (UNIMPLEMENTED / FAILED_PRECONDITION), one that cannot reach a block, or
    one whose decode failed its checks: the restorer solves the chunk itself, as before (stand-ins
    for the bulk paths)."""
    import asyncio
    import types

    import tierckpt
    from tierckptd.parity import rsrebuild

    calls: list[str] = []

    async def far(pulls, man, chunk, chunks, holder, opener):
        calls.append(f"far:{holder}")
        if err is not None:
            raise getattr(tierckpt, err)("stand-in")
        return 100

    async def solve(man, chunk, chunks, plans):
        calls.append("here")
        return b"x" * 10

    wrote: list[tuple[int, bytes]] = []
    monkeypatch.setattr(rsrebuild, "pull_rebuilt", far)
    monkeypatch.setattr(rsrebuild, "write_range", lambda opener, man, off, data: wrote.append((off, bytes(data))))
    metrics = types.SimpleNamespace(parity_rebuild_bulk_bytes=_Counter())
    rb = rsrebuild.RsRebuilder("n0", None, None, 6, None, None, metrics, transfer=object())
    rb.solve_chunk = solve  # type: ignore[method-assign]
    man = types.SimpleNamespace(job="j", step=1, rank=2, nbytes=40)
    asyncio.run(rb._chunk(man, 1, 4, (["plan"], "n3"), None))
    if err is None:
        assert calls == ["far:n3"] and metrics.parity_rebuild_bulk_bytes.n == 100 and not wrote
    else:
        assert calls == ["far:n3", "here"] and wrote == [(10, b"x" * 10)]
    calls.clear()
    asyncio.run(rb._chunk(man, 1, 4, (["plan"], None), None))  # no other row holder: here at once
    assert calls == ["here"]
