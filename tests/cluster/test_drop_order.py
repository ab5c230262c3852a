"""A peer's copy of a new step recycles the files of the step its owner evicted: the owner's
DropReplicas for the evicted step is answered before the next push to that peer begins
(tierckptd.peer.redundancy). Real daemons, real tmpfs files."""

from __future__ import annotations

import os

import numpy as np

from ..harness import Cluster

MIB = 1 << 20
SIZE = 8 * MIB


def _inode(d, step: int) -> int:
    path = next((d.local_dir / "jobs" / "job" / f"{step:020d}").rglob("w.*"))
    return os.stat(path, follow_symlinks=False).st_ino


def test_a_copy_of_the_next_step_takes_the_files_of_the_step_its_owner_evicted(daemon_factory) -> None:
    # The peer answers DropReplicas 1 s late: a push that did not wait for the answer would open
    # the next step's staging area first, in a new file, while the evicted copy is still held.
    # No pool warming, so the only file of the size on offer is the evicted step's.
    knobs = "debug_drop_delay=1,warm_pool=0,warm_hint=0"
    cl = Cluster(daemon_factory, 2, extra=("--keep-local", "1", "--knobs", knobs))
    n0, n1 = cl.d["n0"], cl.d["n1"]
    rng = np.random.default_rng(5)
    with n0.client() as c:
        steps = {}
        for step in (1, 2, 3):
            steps[step] = rng.integers(0, 256, SIZE, dtype=np.uint8)
            fut = c.save("job", step, 0, 1, {"w": steps[step]})
            fut.result()
            assert fut.wait("peer", timeout=30) == ["n1"]
            if step == 1:
                first = _inode(n1, 1)
            else:
                # The evicted step's copy is gone and the new copy lives in its inode.
                assert not (n1.local_dir / "jobs" / "job" / f"{step - 1:020d}").exists()
                assert _inode(n1, step) == first
    with n1.client() as c1:
        assert bytes(c1.restore("job", 0).shards["w"]) == steps[3].tobytes()
