"""The CUDA paths of ``tierckpt.torch`` (README, "Known limitations": the GPU paths — pinned-memory
staging, CUDA RNG state — have not run on a GPU). Marked ``cuda`` and skipped, with the reason,
where ``torch.cuda.is_available()`` is False; on a GPU machine they save CUDA tensors through a
real daemon and check what comes back, on the device, byte for byte:

- a training state on the GPU (module, AdamW state, a bfloat16 and a strided tensor) is restored
  onto the GPU in place, equal to what was saved;
- ``save()`` returns while the GPU is still busy with queued work (it never synchronizes), the
  saved bytes are those of the point of ``save()`` in the stream's order, copied into page-locked
  staging mappings (no pinned pool), or through the reused pinned pool where registration is off;
- the optimizer step after a save waits for ``staged`` (the saved bytes are those before the step);
- ``tierckpt.dcp.Stager``: ``dcp.async_save`` returns while the GPU is busy and stages the bytes
  of that point; bound to its Writer, it copies into page-locked staging mappings (one host copy);
- the CUDA RNG state round-trips (the same random numbers after a load);
- ``map_location="cpu"`` loads a GPU checkpoint into host tensors.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")

from tierckpt.torch import Checkpointer, RNGState  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 50)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.emb(x))))


def _trained(seed: int):
    torch.manual_seed(seed)
    model = Tiny().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 50, (4, 9), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 50), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return model, opt


class _Was(NamedTuple):
    """A tensor as it was: its device and a CPU copy of its values."""

    device: torch.device
    values: torch.Tensor


def _host(obj):
    """Every tensor of a nested state as it is now (the live ones change later)."""
    if isinstance(obj, torch.Tensor):
        return _Was(obj.device, obj.detach().cpu().clone())
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host(v) for v in obj)
    return obj


def _assert_restored(got, want) -> None:
    """``got`` holds the values of ``want`` on the devices they were saved from."""
    if isinstance(want, _Was):
        assert isinstance(got, torch.Tensor) and got.device == want.device, (got.device, want.device)
        assert got.dtype == want.values.dtype and torch.equal(got.detach().cpu(), want.values)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            _assert_restored(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_restored(g, w)
    else:
        assert got == want


def test_a_gpu_training_state_is_restored_onto_the_gpu(daemon) -> None:
    model, opt = _trained(0)
    extra = {"bf16": torch.randn(3, 5, device="cuda").to(torch.bfloat16),
             "strided": torch.arange(24.0, device="cuda").reshape(4, 6)[:, ::2]}
    want = {"model": _host(model.state_dict()), "optim": _host(opt.state_dict()), "extra": _host(extra)}
    with Checkpointer("gpu", address=daemon.address) as ck:
        ck.save(1, {"model": model, "optim": opt, "extra": extra}).result(60)
        model2, opt2 = _trained(1)  # other values, same layout
        extra2: dict = {}
        got = ck.load({"model": model2, "optim": opt2, "extra": extra2})
    assert got is not None and got.step == 1 and got.tier == "local"
    _assert_restored(model2.state_dict(), want["model"])  # on the GPU, as saved
    _assert_restored(opt2.state_dict()["state"], want["optim"]["state"])  # (AdamW's step stays on the host)
    _assert_restored(extra2, want["extra"])
    assert all(p.is_cuda for p in model2.parameters()) and extra2["bf16"].is_cuda


def _slow_work_then(w: torch.Tensor, value: float) -> float:
    """Queue ~0.2 s or more of matmuls on the current stream, then ``w.fill_(value)``; returns the
    seconds the matmuls take on their own (measured first, with events)."""
    a = torch.randn(4096, 4096, device="cuda") / 64

    def burn() -> None:
        x = a
        for _ in range(40):
            x = torch.tanh(x @ a)

    burn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    burn()
    end.record()
    end.synchronize()
    burn()  # queued again: the save below is called while this runs
    w.fill_(value)
    return start.elapsed_time(end) / 1000


@pytest.mark.parametrize("register", [True, False], ids=["registered-staging-maps", "pinned-pool"])
def test_save_does_not_wait_for_the_gpu_and_saves_the_bytes_of_save_time(daemon, register) -> None:
    w = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB
    small = torch.zeros(100, device="cuda")  # packed on the device
    with Checkpointer("async", address=daemon.address) as ck:
        ck._copier.register = register
        ck._copier.refused = not register
        busy = _slow_work_then(w, 7.0)
        small.fill_(3.0)
        t0 = time.perf_counter()
        fut = ck.save(1, {"w": w, "small": small})
        blocking = time.perf_counter() - t0
        assert blocking < busy / 2, (blocking, busy)  # save() did not wait for the queued work
        ck.wait_staged(60)
        assert fut.staged.done() and fut.staged.exception() is None
        w.fill_(9.0)  # staged: the trainer may change the tensors
        small.fill_(4.0)
        fut.result(60)
        got = ck.read(1).state
        assert torch.equal(got["w"], torch.full((64 << 20,), 7.0))
        assert torch.equal(got["small"], torch.full((100,), 3.0))
        if register:  # one host copy: no pinned pool was needed (the staging maps were page-locked)
            assert not ck._copier.refused and ck._copier._pool == []
        else:
            assert len(ck._copier._pool) == 2 and all(b.is_pinned() for b in ck._copier._pool)


def test_the_optimizer_step_after_a_save_waits_for_staged(daemon) -> None:
    model, opt = _trained(0)
    want = _host(model.state_dict())
    with Checkpointer("step", address=daemon.address) as ck:
        fut = ck.save(1, {"model": model, "optim": opt})
        x = torch.randint(0, 50, (4, 9), device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 50), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()  # the pre-step hook waited for staged
        assert fut.staged.done()
        fut.result(60)
        _assert_restored(ck.read(1).state["model"], {k: _Was(torch.device("cpu"), v.values) for k, v in want.items()})


def test_cuda_rng_state_round_trips(daemon) -> None:
    torch.zeros(1, device="cuda")  # CUDA initialised: RNGState includes every device's generator
    torch.cuda.manual_seed_all(3)
    with Checkpointer("rng", address=daemon.address) as ck:
        ck.save(1, {"rng": RNGState()}).result(60)
        a = torch.rand(8, device="cuda")
        torch.cuda.manual_seed_all(99)
        ck.load({"rng": RNGState()})
        b = torch.rand(8, device="cuda")
    assert torch.equal(a, b)


def test_map_location_cpu_loads_a_gpu_checkpoint_into_host_tensors(daemon) -> None:
    t = torch.randn(64, 64, device="cuda")
    with Checkpointer("maploc", address=daemon.address) as ck:
        ck.save(1, {"t": t, "nested": {"u": t[:, :3]}}).result(60)
    with Checkpointer("maploc", address=daemon.address, map_location="cpu") as ck:
        state: dict = {"t": None, "nested": {}}
        ck.load(state)
    assert state["t"].device.type == "cpu" and torch.equal(state["t"], t.cpu())
    assert state["nested"]["u"].device.type == "cpu" and torch.equal(state["nested"]["u"], t[:, :3].cpu())


def test_dcp_stager_returns_before_the_gpu_copy_and_stages_the_bytes_of_stage_time(daemon) -> None:
    import tierckpt
    import tierckpt.dcp as tdcp
    import torch.distributed.checkpoint as dcp

    w = torch.zeros(32 << 20, device="cuda")  # 128 MiB
    busy = _slow_work_then(w, 5.0)
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        t0 = time.perf_counter()
        resp = dcp.async_save({"w": w}, storage_writer=tdcp.Writer("dcpgpu", 1, client=c), async_stager=stager,
                              no_dist=True)
        assert time.perf_counter() - t0 < busy / 2  # async_save did not wait for the queued GPU work
        resp.staging_completion.result(60)
        w.fill_(6.0)  # staged: the tensor may change
        resp.upload_completion.result(60)
        got = {"w": torch.empty(32 << 20)}
        dcp.load(got, storage_reader=tdcp.Reader("dcpgpu", 1, client=c), no_dist=True)
    stager.close()
    assert torch.equal(got["w"], torch.full((32 << 20,), 5.0))


def test_bound_dcp_stager_copies_the_gpu_tensor_once_into_page_locked_staging_mappings(daemon) -> None:
    import tierckpt
    import tierckpt.dcp as tdcp
    import torch.distributed.checkpoint as dcp

    w = torch.zeros(32 << 20, device="cuda")  # 128 MiB: its own shard, copied by the TensorCopier
    small = torch.full((8,), 3.0, device="cuda")  # packed on the device in stage()
    busy = _slow_work_then(w, 5.0)
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        t0 = time.perf_counter()
        resp = dcp.async_save({"w": w, "small": small},
                              storage_writer=tdcp.Writer("dcpgpu1", 1, client=c, stager=stager),
                              async_stager=stager, no_dist=True)
        assert time.perf_counter() - t0 < busy / 2  # stage() did not wait for the queued GPU work
        resp.staging_completion.result(60)
        w.fill_(6.0)  # staged: the tensors may change
        small.fill_(4.0)
        resp.upload_completion.result(60)
        assert stager._copier is not None and not stager._copier.refused  # page-locked mappings, no pinned pool
        got = {"w": torch.empty(32 << 20), "small": torch.empty(8)}
        dcp.load(got, storage_reader=tdcp.Reader("dcpgpu1", 1, client=c), no_dist=True)
    stager.close()
    assert torch.equal(got["w"], torch.full((32 << 20,), 5.0))
    assert torch.equal(got["small"], torch.full((8,), 3.0))
