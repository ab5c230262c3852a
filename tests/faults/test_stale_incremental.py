"""Incremental saves that cannot go stale (issue 25): only the very storage the last committed
save held, unmoved, counts as unchanged; every case restores exactly what was saved. A real
daemon, tierckpt.torch Checkpointer(incremental=True); the happy path (frozen parameters linked)
is tests/test_torch_incremental.py."""

from __future__ import annotations

import torch
from tierckpt.torch import Checkpointer

from ..test_torch_incremental import _model


def _incremental(daemon, job: str) -> Checkpointer:
    return Checkpointer(job, address=daemon.address, pack_below=1024, incremental=True)


def test_a_tensor_recreated_out_of_place_each_step_is_written_each_step(daemon, matrix):
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
    matrix.record(corrupt_returned=0)  # every restore above compared byte for byte


def test_a_new_tensor_at_a_freed_address_with_the_same_version_is_written(daemon, matrix):
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
    matrix.record(corrupt_returned=0)  # every restore above compared byte for byte


def test_an_out_of_place_ema_and_reallocated_optimizer_state_are_never_stale(daemon, matrix):
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
    matrix.record(corrupt_returned=0)  # every restore above compared byte for byte


def test_a_frozen_parameter_is_still_shared_through_state_dict_views(daemon, matrix):
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
    matrix.record(corrupt_returned=0)  # every restore above compared byte for byte


def test_only_plain_dense_tensors_get_a_fingerprint() -> None:
    from tierckpt.torch import _fingerprint

    t = torch.zeros(8)
    a, b = _fingerprint(t), _fingerprint(t.view(2, 4).view(8))
    assert a is not None and a.same(b)  # a view of the same storage, same layout
    assert not a.same(_fingerprint(t.clone()))  # another storage with the same bytes
    t.add_(1)
    assert not a.same(_fingerprint(t))  # the version moved
    assert _fingerprint(torch.zeros(8).to_sparse()) is None
    assert _fingerprint(torch.empty(8, device="meta")) is None
