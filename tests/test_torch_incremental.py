"""tierckpt.torch Checkpointer(incremental=True): frozen parameters are shared with the previous
committed step (linked by the daemon), trained ones are written. A real daemon."""

from __future__ import annotations

import os

import pytest
import torch
from tierckpt.torch import Checkpointer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    for p in m[0].parameters():
        p.requires_grad_(False)  # frozen (e.g. an embedding or a base model under a LoRA head)
    return m


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    m(torch.randn(8, 256)).sum().backward()
    opt.step()


def _inode(daemon, step: int, shard: str) -> os.stat_result:
    (p,) = daemon.local_dir.glob(f"jobs/inc/{step:020d}/rank-0000000/{shard}.*")
    return os.stat(p)


@pytest.mark.parametrize("incremental", [True, False])
def test_frozen_params_are_shared_and_trained_ones_written(daemon, incremental):
    m = _model()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    with Checkpointer("inc", address=daemon.address, pack_below=1024, incremental=incremental) as ck:
        assert ck.save(1, {"model": m}).result(30).shared_bytes == 0
        _train(m, opt)
        r = ck.save(2, {"model": m}).result(30)
        frozen = 256 * 256 * 4  # 0.weight; 0.bias (1 KiB) has its own shard too
        assert r.shared_bytes == ((frozen + 1024) if incremental else 0)
        want = {k: v.clone() for k, v in m.state_dict().items()}
        with torch.no_grad():
            m[1].weight.add_(1.0)  # an in-place op bumps the version counter: written again
        r = ck.save(3, {"model": m}).result(30)
        assert r.shared_bytes == ((frozen + 1024 + 1024) if incremental else 0)  # 1.bias unchanged since 2
        got = ck.read(2).state["model"]
        assert all(torch.equal(got[k], want[k]) for k in want)
        got3 = ck.read(3).state["model"]
        assert torch.equal(got3["1.weight"], want["1.weight"] + 1) and torch.equal(got3["0.weight"], want["0.weight"])
    w2, w3 = _inode(daemon, 2, "t.model.0.weight"), _inode(daemon, 3, "t.model.0.weight")
    assert (w2.st_ino == w3.st_ino) == incremental
    assert _inode(daemon, 2, "t.model.1.weight").st_ino != _inode(daemon, 3, "t.model.1.weight").st_ino
