"""Several readers on a replaced node restore the same rank at once (as the ranks of a DCP load
do: each reads the metadata rank, several read the same data rank). Each restore must succeed
with the right bytes, whether the rank comes from the peer tier or the persistent tier, and
while the owner pushes its replica back to the node (found by tests/dcp/test_elastic.py: the
concurrent fetches voided each other's staging)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np

from ..harness import Cluster, wait_until

READERS = 6


def _restore_all(node, job: str, ranks: list[int]) -> list[tuple[int, str, bytes]]:
    def one(rank: int) -> tuple[int, str, bytes]:
        with node.client() as c:
            ck = c.restore(job, rank, 1)
            return rank, ck.tier, ck.shards["w"].tobytes()

    with cf.ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


def test_concurrent_restores_of_one_rank_on_a_replaced_node(daemon_factory, scratch):
    persistent = scratch / "persistent"
    persistent.mkdir()
    cluster = Cluster(daemon_factory, 2, replicas=1, extra=("--persistent", f"file://{persistent}"))
    data = {r: np.random.default_rng(r).integers(0, 255, 3 << 20, dtype=np.uint8) for r in range(2)}
    with cluster.d["n0"].client() as c:
        for r in range(2):
            c.save("cf", 1, r, 2, {"w": data[r]}, persist=True).wait("persistent", timeout=60)
        wait_until(lambda: all(len(r.nodes) == 2 for r in c.list("cf")[0].ranks), what="replicated")
    cluster.replace("n1")  # n1 lost its copies: they come from n0 (the peer tier)
    cluster.wait_peers("n1")
    got = _restore_all(cluster.d["n1"], "cf", [0, 1] * (READERS // 2))
    assert all(b == data[r].tobytes() for r, _, b in got)
    assert {t for _, t, _ in got} <= {"peer", "local"} and "peer" in {t for _, t, _ in got}
    for node in ("n0", "n1"):  # every local dir lost: the persistent tier, while n0 re-replicates
        cluster.replace(node)
    for node in cluster.ids:
        cluster.wait_peers(node)
    with cf.ThreadPoolExecutor(2) as pool:
        both = [pool.submit(_restore_all, cluster.d[n], "cf", [0, 1] * (READERS // 2)) for n in ("n0", "n1")]
        got = [x for f in both for x in f.result()]
    assert all(b == data[r].tobytes() for r, _, b in got)
    assert "persistent" in {t for _, t, _ in got}
