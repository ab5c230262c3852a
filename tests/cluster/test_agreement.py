"""Restore-step agreement through the job's process group: two real processes over gloo, one
daemon; rank 1's newest step is missing, so both ranks agree on the step before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tierckpt.agree import newest_common_step
from tierckptd.testing import free_port

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    import tierckpt
    from tierckpt.agree import agree_restore_step
    from tierckpt.torch import Checkpointer

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    rank = dist.get_rank()
    with tierckpt.Client(os.environ["TIERCKPT_ADDRESS"]) as c:
        agreed = agree_restore_step(c, "agree", rank)
        with Checkpointer("agree", client=c) as ck:
            via_checkpointer = ck.latest()
        mine = [a.step for a in c.availability("agree", rank)]
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "agreed": agreed, "checkpointer": via_checkpointer, "mine": mine}), flush=True)
    os._exit(0)  # checked and destroyed: skip finalization, where torch's C++ threads rarely abort
""")


def test_newest_common_step_rule():
    assert newest_common_step([[1, 2, 3], [1, 2]]) == 2
    assert newest_common_step([[3], [1, 2]]) is None
    assert newest_common_step([]) is None


def test_two_ranks_agree_on_the_newest_step_both_can_restore(daemon):
    with daemon.client() as c:
        for step in (1, 2, 3):
            c.save("agree", step, 0, 2, {"w": bytes([step]) * 100}).result(timeout=30)
        for step in (1, 2):  # rank 1 never committed step 3
            c.save("agree", step, 1, 2, {"w": bytes([step]) * 100}).result(timeout=30)
        assert c.latest("agree") == 2
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TIERCKPT_ADDRESS": daemon.address}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    by_rank = {o["rank"]: o for o in outs}
    assert by_rank[0]["mine"] == [1, 2, 3] and by_rank[1]["mine"] == [1, 2]
    assert all(o["agreed"] == 2 and o["checkpointer"] == 2 for o in outs)
