"""A 16-daemon cluster on loopback: each daemon talks only to its ring neighbourhood, and one
rank's availability is answered from its node's neighbourhood."""

from __future__ import annotations

import re

import pytest
from tierckptd.cluster import ring

from ..harness import Cluster, wait_until
from ..metrics_scrape import scrape

N = 16


def _calls_by_peer(port: int) -> dict[str, float]:
    return {m.group(1): v for series, v in scrape(port).items()
            if (m := re.fullmatch(r'tierckpt_peer_calls_total\{peer="([^"]+)"\}', series))}


@pytest.mark.slow
def test_each_daemon_talks_only_to_its_neighbourhood(daemon_factory):
    cl = Cluster(daemon_factory, N, extra=("--knobs", "refresh_interval=0.3"), wait=False, metrics=True)
    job = "scale"
    for i, node in enumerate(cl.ids):  # rank i saved on node i, one replica each
        with cl.d[node].client() as c:
            c.save(job, 1, i, N, {"w": bytes([i]) * 1000}).wait("peer", timeout=60)
    for node in cl.ids:  # everyone up: the neighbourhoods settle
        with cl.d[node].client() as c:
            hood = set(ring.neighbourhood(node, cl.ids, replicas=1))
            wait_until(lambda: {p.node_id for p in c.status().peers if p.up} >= hood, what=f"{node} sees {hood}")
    hoods = {node: set(ring.neighbourhood(node, cl.ids, replicas=1)) for node in cl.ids}

    def calls() -> dict[str, dict[str, float]]:
        return {node: _calls_by_peer(cl.d[node].info["metrics_port"]) for node in cl.ids}

    def rounds_since(then: dict[str, dict[str, float]], n: int):
        """Whether every node called each neighbour ``n`` more times since ``then`` (n refresh rounds)."""
        now = calls()
        return all(now[node].get(p, 0) >= then[node].get(p, 0) + n for node in cl.ids for p in hoods[node]) and now

    # Settled: two refresh rounds everywhere since everyone was up (start-up calls are over).
    start = calls()
    before = wait_until(lambda: rounds_since(start, 2), what="two refresh rounds on every node", interval=0.5)
    after = wait_until(lambda: rounds_since(before, 5), what="five refresh rounds on every node", interval=0.5)
    for node in cl.ids:
        called = {p for p, n in after[node].items() if n > before[node].get(p, 0)}
        assert called == hoods[node], f"{node} called {sorted(called - hoods[node])} outside {sorted(hoods[node])}"
    # A replacement for n5 finds its rank among its ring successors, without asking everyone.
    cl.replace("n5")
    with cl.d["n5"].client() as c:
        hood = set(ring.neighbourhood("n5", cl.ids, replicas=1))
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} >= hood, what="n5 sees its neighbours")
    with cl.d["n5"].client() as c:
        avail = wait_until(lambda: c.availability(job, 5), what="n5 sees its rank in its neighbourhood")
        assert [(a.step, a.tiers, a.nodes) for a in avail] == [(1, ("peer",), ("n6",))]
        ck = c.restore(job, 5, 1)
        assert ck.tier == "peer" and bytes(ck.shards["w"]) == bytes([5]) * 1000
    called = {p for p, n in _calls_by_peer(cl.d["n5"].info["metrics_port"]).items() if n > 0}
    assert called <= set(ring.neighbourhood("n5", cl.ids, replicas=1))
    with cl.d["n0"].client() as c:  # the operator query still sees the whole cluster
        assert c.latest(job) == 1
