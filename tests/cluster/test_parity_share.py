"""Parity shared with the base step (issue 32 item 4, :mod:`tierckptd.parity.share`), real daemons
on loopback: a step whose shards are all unchanged pulls nothing for its parity (its slots/rows
are hard-linked from the base step's); a step with one changed rank pulls that rank's old and new
chunks only (the slots/rows it is in are updated by delta); a step with every rank changed is
encoded anew. A wiped node's ranks restore exactly from the shared parity, also once the base
step was evicted (its parity dropped) by retention."""

from __future__ import annotations

import numpy as np
import pytest
from tierckpt.common import checksum as _checksum

from ..harness import Cluster, wait_until
from ..metrics_scrape import scrape

PULLED = "tierckpt_parity_pulled_bytes_total"
LINKED = "tierckpt_parity_linked_bytes_total"


def shard(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def _data(world: int, changed: dict[int, int]) -> dict[int, dict[str, np.ndarray]]:
    """Two shards per rank; rank r's ``a`` drawn with seed ``changed.get(r, 0)`` (the version)."""
    return {r: {"a": shard(1000 * changed.get(r, 0) + r, 120_000 + 4_099 * r), "b": shard(500 + r, 333 + r)}
            for r in range(world)}


def _save(cl: Cluster, job: str, step: int, data: dict[int, dict[str, np.ndarray]], unchanged: set[int]) -> None:
    """Rank r saved on node n{r % nodes}, all at once (the unchanged ranks say so); wait('peer')."""
    world = len(data)
    clients, futs = [], []
    try:
        for rank, shards in data.items():
            c = cl.d[cl.ids[rank % len(cl.ids)]].client()
            clients.append(c)
            futs.append(c.save(job, step, rank, world, shards, metadata={"rank": rank},
                               unchanged=["a", "b"] if rank in unchanged else ()))
        for fut in futs:
            fut.wait("peer", timeout=90)
    finally:
        for c in clients:
            c.close()


def _metric(cl: Cluster, name: str) -> float:
    return sum(scrape(d.info["metrics_port"]).get(name, 0.0) for d in cl.d.values())


def _files(cl: Cluster, pdir: str, job: str, step: int) -> list:
    return [p for d in cl.d.values() for p in (d.local_dir / pdir / job / f"{step:020d}").glob("*.bin")]


def _check(cl: Cluster, node: str, job: str, step: int, rank: int, shards: dict[str, np.ndarray]) -> None:
    with cl.d[node].client() as c:
        ck = c.restore(job, rank, step=step)
        assert ck.tier == "peer"
        assert {n: _checksum.digest(np.asarray(v)) for n, v in ck.shards.items()} == {
            n: _checksum.digest(v) for n, v in shards.items()}
        assert ck.metadata == {"rank": rank}


@pytest.mark.parametrize("redundancy,pdir", [("parity:4+1", "parity"), ("parity:3+2", "parity-rs")])
def test_unchanged_ranks_share_parity_changed_ones_are_pulled_restores_exact(daemon_factory, redundancy, pdir):
    cl = Cluster(daemon_factory, 5, replicas=0, metrics=True,
                 extra=("--redundancy", redundancy, "--keep-local", "3"))
    job, world = "share", 10  # two ranks per node
    v1 = _data(world, {})
    fresh = sum(s.nbytes for r in v1.values() for s in r.values())
    _save(cl, job, 1, v1, set())
    m = 1 if redundancy.endswith("+1") else 2
    assert _metric(cl, PULLED) == pytest.approx(m * fresh, rel=0.01)  # every chunk pulled once per parity row
    assert _metric(cl, LINKED) == 0

    # step 2: every shard unchanged: no parity byte pulled, every slot/row linked from step 1
    _save(cl, job, 2, v1, set(range(world)))
    assert _metric(cl, PULLED) == pytest.approx(m * fresh, rel=0.01)
    assert _metric(cl, LINKED) == pytest.approx(m * fresh, rel=0.01)
    one, two = _files(cl, pdir, job, 1), _files(cl, pdir, job, 2)
    assert len(one) == len(two) > 0
    assert {p.stat().st_ino for p in one} == {p.stat().st_ino for p in two}  # the same files

    # step 3: rank 0 changed: the slots/rows holding one of its chunks are updated by its delta
    # (old and new chunk pulled), the others linked
    v3 = _data(world, {0: 3})
    before = _metric(cl, PULLED)
    _save(cl, job, 3, v3, set(range(1, world)))
    rank0 = sum(s.nbytes for s in v3[0].values())
    assert _metric(cl, PULLED) - before == pytest.approx(2 * m * rank0, rel=0.01)
    three = _files(cl, pdir, job, 3)
    assert 0 < len({p.stat().st_ino for p in three} & {p.stat().st_ino for p in two}) < len(three)

    # step 4: every rank changed: a delta would cost more than encoding anew, which is done
    v4 = _data(world, dict.fromkeys(range(world), 4))
    before = _metric(cl, PULLED)
    _save(cl, job, 4, v4, set())
    assert _metric(cl, PULLED) - before == pytest.approx(m * fresh, rel=0.01)

    # retention (keep 3) evicted step 1 everywhere: its parity is dropped, the later steps keep theirs
    wait_until(lambda: not _files(cl, pdir, job, 1), timeout=60, what="step 1's parity dropped")
    assert len(_files(cl, pdir, job, 2)) == len(two)

    # kill -9 and wipe a node: its ranks of steps 2-4 are rebuilt exactly from the shared parity
    cl.replace("n2")
    cl.wait_peers("n2")
    for rank in (2, 7):
        _check(cl, "n2", job, 2, rank, v1[rank])
        _check(cl, "n2", job, 3, rank, v3[rank])
        _check(cl, "n2", job, 4, rank, v4[rank])
