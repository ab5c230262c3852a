"""One rank of tests/integrations/test_manager.py's agreement test (gloo, 2 processes, one daemon)."""

import os
import sys

import numpy as np
import torch.distributed as dist
from tierckpt.manager import CheckpointManager

rank, world = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=world)
with CheckpointManager("agree", policy=1) as mgr:
    assert (mgr.rank, mgr.world_size) == (rank, world)
    steps = (1, 2, 3) if rank == 0 else (1, 2)  # rank 1 never saved step 3
    for s in steps:
        mgr.save(s, {"w": np.full(4, s + rank, np.float32)})
    mgr.wait_until_finished()
    dist.barrier()
    step = mgr.latest_step()
    got = mgr.restore()
    assert got is not None and got.step == step and got.state["w"][0] == step + rank
dist.destroy_process_group()
print("agreed", step, flush=True)
os._exit(0)  # checked and destroyed: skip finalization, where torch's C++ threads rarely abort
