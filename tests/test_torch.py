"""tierckpt.torch: whole training states through a real daemon."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import tierckpt
import torch
from tierckpt.torch import PACKED_SHARD, Checkpointer, RNGState


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: stored once
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.norm(self.drop(torch.relu(self.mid(self.emb(x))))))


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model, opt, sched, gen) -> float:
    x = torch.randint(0, 50, (4, 9), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 50), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def state_of(model, opt, sched, gen, extra) -> dict:
    return {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "loader": gen, "extra": extra}


def test_round_trip_restores_everything_exactly(daemon):
    model, opt, sched = make(0)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        train_step(model, opt, sched, gen)
    strided = torch.arange(24.0).reshape(4, 6)[:, ::2]
    extra = {"epoch": 2, "np": np.arange(6).reshape(2, 3), "half": torch.randn(3, 5).to(torch.bfloat16),
             "strided": strided, "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5), "odd key/é": [1, "x"]}
    with Checkpointer("rt", address=daemon.address) as ck:
        res = ck.save(7, state_of(model, opt, sched, gen, extra), metadata={"note": "hi"}).result()
        assert res.step == 7 and ck.stats.committed == 1 and ck.stats.failed == 0
        draws = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 50, (5,), generator=gen))

        model2, opt2, sched2 = make(1)  # different init, fresh optimizer without state
        gen2 = torch.Generator().manual_seed(99)
        extra2 = {"epoch": 0}
        state2 = state_of(model2, opt2, sched2, gen2, extra2)
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        got = ck.load(state2)
    assert got.step == 7 and got.tier == "local" and got.metadata == {"note": "hi"} and got.seconds > 0
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    assert model2.head.weight is model2.emb.weight  # tying survives in-place load
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for p in s1["state"]:
        for k in s1["state"][p]:
            assert torch.equal(s1["state"][p][k], s2["state"][p][k]), (p, k)
    assert sched2.state_dict() == sched.state_dict()
    assert extra2["epoch"] == 2 and extra2["odd key/é"] == [1, "x"] and np.array_equal(extra2["np"], extra["np"])
    for k in ("half", "strided", "empty", "scalar"):
        assert extra2[k].dtype == extra[k].dtype and torch.equal(extra2[k], extra[k]), k
    # RNG streams continue exactly where the saved run left them.
    assert random.random() == draws[0] and np.random.rand() == draws[1] and torch.equal(torch.rand(3), draws[2])
    assert torch.equal(torch.randint(0, 50, (5,), generator=gen2), draws[3])


def test_load_is_in_place_and_read_is_zero_copy(daemon):
    model, opt, sched = make(0)
    gen = torch.Generator().manual_seed(0)
    train_step(model, opt, sched, gen)
    top = torch.arange(10.0)
    with Checkpointer("inplace", address=daemon.address, pack_below=1024) as ck:
        ck.save(1, {"model": model, "optim": opt, "top": top}).result()
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        opt_ptrs = {id(p): {k: v.data_ptr() for k, v in s.items()} for p, s in opt.state.items()}
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_step(model, opt, sched, gen)  # drift away from the checkpoint
        top.add_(1)
        top_ptr = top.data_ptr()
        state = {"model": model, "optim": opt, "top": top}
        ck.load(state)
        assert state["top"] is top and top.data_ptr() == top_ptr and torch.equal(top, torch.arange(10.0))
        for n, p in model.named_parameters():
            assert p.data_ptr() == ptrs[n] and torch.equal(p, want[n]), n
        for p, s in opt.state.items():
            assert {k: v.data_ptr() for k, v in s.items()} == opt_ptrs[id(p)]
        train_step(model, opt, sched, gen)  # restored buffers are writable

        got = ck.read(1)
        w, b = got.state["model"]["mid.weight"], got.state["model"]["mid.bias"]
        assert torch.equal(w, want["mid.weight"]) and torch.equal(b, want["mid.bias"])
        # mid.weight (16 KiB) has its own shard; the bias (256 B) and LayerNorm params are views
        # into the one packed shard: no copies were made.
        ln_w, ln_b = got.state["model"]["norm.weight"], got.state["model"]["norm.bias"]
        assert ln_w.untyped_storage().data_ptr() == ln_b.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert w.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        shards = daemon.client().restore("inplace", 0, 1).shards
        assert PACKED_SHARD in shards and "t.model.mid.weight" in shards and "t.model.head.weight" not in shards


def test_resume_continues_training_exactly(daemon):
    model, opt, sched = make(0)
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(11)
    with Checkpointer("resume", address=daemon.address) as ck:
        losses = []
        for step in range(1, 7):
            losses.append(train_step(model, opt, sched, gen))
            if step == 3:
                ck.save(step, {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "gen": gen})
        ck.wait()
        model2, opt2, sched2 = make(5)
        gen2 = torch.Generator()
        got = ck.load({"model": model2, "optim": opt2, "sched": sched2, "rng": RNGState(), "gen": gen2})
        assert got.step == ck.latest() == 3
        resumed = [train_step(model2, opt2, sched2, gen2) for _ in range(3)]
    assert resumed == losses[3:]  # dropout, Adam moments, LR schedule and data all continue bitwise


def test_save_failure_does_not_kill_training(daemon, caplog):
    model, opt, sched = make(0)
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer("fail", address=daemon.address)
    ck.save(1, {"model": model}).result()
    daemon.kill()
    fut = ck.save(2, {"model": model, "optim": opt})
    assert isinstance(fut.exception(timeout=10), tierckpt.UnavailableError)
    assert ck.stats.failed == 1 and ck.stats.committed == 1 and "UnavailableError" in ck.stats.last_error
    assert "checkpoint save of fail step 2 rank 0 failed" in caplog.text
    train_step(model, opt, sched, gen)  # training goes on
    ck.wait()
    ck.close()

    strict = Checkpointer("fail", address=daemon.address, raise_on_error=True)
    with pytest.raises(tierckpt.UnavailableError):
        strict.save(3, {"model": model})
    assert strict.stats.failed == 1
    strict.close()


def test_full_local_tier_gives_failed_future_or_raises(daemon_factory):
    d = daemon_factory("small", args=("--local-capacity", "20000"))
    big = {"w": torch.zeros(100_000)}
    with Checkpointer("full", address=d.address) as ck:
        fut = ck.save(1, big)
        assert isinstance(fut.exception(timeout=10), tierckpt.CapacityError) and ck.stats.failed == 1
        assert ck.save(2, {"w": torch.zeros(100)}).result().step == 2  # small saves still work
    with Checkpointer("full", address=d.address, raise_on_error=True) as ck, pytest.raises(tierckpt.CapacityError):
        ck.save(3, big)


def test_missing_checkpoint_and_strict_keys(daemon):
    with Checkpointer("none", address=daemon.address) as ck:
        assert ck.load({"x": torch.zeros(2)}) is None and ck.read() is None
        with pytest.raises(tierckpt.NotFoundError):
            ck.load({"x": torch.zeros(2)}, step=4)
        ck.save(1, {"x": torch.ones(2)}).result()
        with pytest.raises(KeyError, match="y"):
            ck.load({"x": torch.zeros(2), "y": 1})
        state = {"x": torch.zeros(2), "y": 1}
        ck.load(state, strict=False)
        assert torch.equal(state["x"], torch.ones(2)) and state["y"] == 1


def test_client_does_not_import_torch():
    code = "import sys, tierckpt, tierckpt.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
