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


# -- incremental saves that cannot go stale (issue 25 item 2): only the very storage of the last
# committed save, unmoved, counts as unchanged; every case below restores exactly what was saved


def _incremental(daemon, job: str) -> Checkpointer:
    return Checkpointer(job, address=daemon.address, pack_below=1024, incremental=True)


def test_a_tensor_recreated_out_of_place_each_step_is_written_each_step(daemon):
    """A 4 MiB buffer dropped and re-made every step (it may land at the freed address with the
    same version counter): written every step, never linked."""
    with _incremental(daemon, "recreate") as ck:
        buf = torch.empty(1 << 20)
        buf.fill_(1.0)
        for step in range(1, 6):  # the daemon keeps 2 steps: each is read back before the next
            r = ck.save(step, {"buf": buf}).result(30)
            assert r.shared_bytes == 0
            assert torch.equal(ck.read(step).state["buf"], torch.full((1 << 20,), float(step)))
            del buf
            buf = torch.empty(1 << 20)
            buf.fill_(float(step + 1))  # the same version counter as the freed one


def test_a_new_tensor_at_a_freed_address_with_the_same_version_is_written(daemon):
    """The address reuse made certain: two tensors over the same memory, one after the other."""
    mem = bytearray(1 << 16)
    with _incremental(daemon, "reuse") as ck:
        first = torch.frombuffer(mem, dtype=torch.float32)
        ck.save(1, {"w": first}).result(30)
        where = (first.data_ptr(), first._version, first.shape)
        del first
        mem[:] = b"\x01" * len(mem)  # new bytes at the same address, no tensor op
        second = torch.frombuffer(mem, dtype=torch.float32)
        assert (second.data_ptr(), second._version, second.shape) == where  # the old rule's blind spot
        assert ck.save(2, {"w": second}).result(30).shared_bytes == 0
        assert torch.equal(ck.read(2).state["w"], second)


def test_an_out_of_place_ema_and_reallocated_optimizer_state_are_never_stale(daemon):
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ema = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with _incremental(daemon, "ema") as ck:
        for step in range(1, 5):
            opt.zero_grad(set_to_none=True)  # gradients re-allocated every step
            m(torch.randn(4, 64)).sum().backward()
            opt.step()
            ema = {k: ema[k] * 0.9 + v.detach() * 0.1 for k, v in m.state_dict().items()}  # out of place
            grads = {n: p.grad for n, p in m.named_parameters()}
            ck.save(step, {"model": m, "opt": opt, "ema": ema, "grads": grads}).result(30)
            got = ck.read(step).state  # the daemon keeps 2 steps: read each back at once
            assert all(torch.equal(got["ema"][k], ema[k]) for k in ema), step
            assert all(torch.equal(got["grads"][k], grads[k]) for k in grads), step
            assert all(torch.equal(got["model"][k], v) for k, v in m.state_dict().items()), step
        # optimizer state replaced by load_state_dict: new tensors, maybe at freed addresses
        other = torch.optim.Adam(m.parameters(), lr=0.1)
        other.load_state_dict(opt.state_dict())
        for st in other.state.values():
            st["exp_avg"].mul_(0)  # different bytes, every tensor
        opt.load_state_dict(other.state_dict())
        ck.save(5, {"opt": opt}).result(30)  # exp_avg_sq is the same storage, unmoved: it may be linked
        got5 = ck.read(5).state["opt"]["state"]
        assert all(torch.count_nonzero(s["exp_avg"]) == 0 for s in got5.values())
        assert all(torch.equal(got5[i][k], v) for i, st in opt.state_dict()["state"].items() for k, v in st.items())


def test_a_frozen_parameter_is_still_shared_through_state_dict_views(daemon):
    """The sound rule keeps the point of incremental saves: state_dict() hands out new detached
    tensors every call, but they are views of the same storage with the same version."""
    m = _model()
    with _incremental(daemon, "frozen") as ck:
        ck.save(1, {"model": m.state_dict()}).result(30)
        r = ck.save(2, {"model": m.state_dict()}).result(30)
        assert r.shared_bytes >= 256 * 256 * 4 * 2  # both layers untouched
        with torch.no_grad():
            m[1].weight.mul_(2)
        r = ck.save(3, {"model": m.state_dict()}).result(30)
        assert torch.equal(ck.read(3).state["model"]["1.weight"], m[1].weight)
        assert r.shared_bytes < 256 * 256 * 4 * 2


def test_only_plain_dense_tensors_get_a_fingerprint():
    from tierckpt.torch import _fingerprint

    t = torch.zeros(8)
    a, b = _fingerprint(t), _fingerprint(t.view(2, 4).view(8))
    assert a is not None and a.same(b)  # a view of the same storage, same layout
    assert not a.same(_fingerprint(t.clone()))  # another storage with the same bytes
    t.add_(1)
    assert not a.same(_fingerprint(t))  # the version moved
    assert _fingerprint(torch.zeros(8).to_sparse()) is None
    assert _fingerprint(torch.empty(8, device="meta")) is None
