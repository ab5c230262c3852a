"""`tierckpt rm` is final (issue 24 item 5), on real daemons: a step deleted while its drains are
in flight to a slow store never comes back, in any tier, in `ls` or `latest()`, across restarts.
The races themselves (a manifest put in flight, a node that missed the delete, a killed drain)
are pinned down in process: tests/persistent/test_tombstone.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tierckpt

from ..harness import Cluster, wait_until

SLOW = "--knobs=refresh_interval=0.2,down_retry_max=0.5,debug_manifest_delay=3"


def _rank(step: int, rank: int) -> dict[str, np.ndarray]:
    return {"model": np.full(50_000, step * 10 + rank, dtype=np.uint8)}


def _manifests(store: Path, step: int) -> list[str]:
    d = store / "job" / "manifests" / f"{step:020d}"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_rm_during_in_flight_drains_is_final_across_restarts(daemon_factory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    cl = Cluster(daemon_factory, 2, replicas=1,
                 extra=("--persistent", f"file://{store}", "--persist-every", "1", SLOW))
    n0, n1 = cl.d["n0"], cl.d["n1"]
    with n0.client() as c0, n1.client() as c1:
        saves = [c.save("job", 1, rank, 2, _rank(1, rank)) for c, rank in ((c0, 0), (c1, 1))]
        for fut in saves:
            fut.wait("peer", timeout=60)
        # both drains have stored their data and wait to publish their manifests (the slow store)
        wait_until(lambda: len(list((store / "job").glob("leases/*"))) >= 2, what="both drains in flight")
        result = c0.delete_step("job", 1)
        assert (result.local, result.peer) == (2, 2) and not result.unreachable
        for fut in saves:  # the owners' drains were cancelled, not failed
            with pytest.raises(tierckpt.TierError, match="deleted on request"):
                fut.wait("persistent", timeout=30)
        # a later step drains through the same slow path, after step 1's attempts woke up
        for c, rank in ((c0, 0), (c1, 1)):
            c.save("job", 2, rank, 2, _rank(2, rank)).wait("persistent", timeout=60)
        assert _manifests(store, 1) == ["deleted.json"]
        for c in (c0, c1):
            assert [i.step for i in c.list("job")] == [2] and c.latest("job") == 2
    n0.restart()
    n1.restart()
    cl.wait_peers("n0")
    with n0.client() as c0, n1.client() as c1:
        for c in (c0, c1):
            assert [i.step for i in c.list("job")] == [2] and c.latest("job") == 2
            with pytest.raises(tierckpt.NotFoundError):
                c.restore("job", 0, step=1)
        assert _manifests(store, 1) == ["deleted.json"]
        # the job resumed from step 0 and saved step 1 again: that save is kept and drained
        c0.save("job", 1, 0, 2, _rank(1, 7)).wait("persistent", timeout=60)
        c1.save("job", 1, 1, 2, _rank(1, 8)).wait("persistent", timeout=60)
        assert len(_manifests(store, 1)) == 3
        got = c1.restore("job", 0, step=1)
        assert np.array_equal(got.tensors()["model"], _rank(1, 7)["model"])
