"""The ordering rules of deferred copies (``staged``), on the CPU, through a real daemon.

A copier that can be held or made to fail stands in for the device copy (``tierckpt._staging``):

- save() returns before the copy; nothing is committed before ``staged`` (the daemon lists no step);
- a failed copy fails ``staged`` and the future, typed, and the save is aborted on the daemon
  (no step, no staging directory left; the same step saves again);
- ``staged`` resolves before the future (the state is handed back before the commit is reported);
- the torch Checkpointer does not wait in save(), but the next optimizer step waits for ``staged``,
  so the saved bytes are those of save() time;
- a streamed save (no shared filesystem) copies deferred shards at once;
- ``save(hold=True)`` stages but commits only on ``commit()`` (with the final metadata), once;
  ``abort()`` and the client's ``close()`` abort a held save: nothing is committed.
"""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest
import tierckpt
from tierckpt._staging import Deferred, HostCopier


class HeldCopier(HostCopier):
    """A host copier that waits for ``go`` before copying, then fails with ``error`` if set."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.error = error
        self.copies = 0

    def copy(self, mark, pairs, io) -> None:
        self.started.set()
        assert self.go.wait(60), "the test never let the copy go"
        if self.error is not None:
            raise self.error
        self.copies += 1
        super().copy(mark, pairs, io)


def _deferred(arr: np.ndarray) -> Deferred:
    return Deferred(arr, arr.nbytes, arr.dtype.str, arr.shape)


def _staging_left(daemon) -> list[str]:
    root = daemon.local_dir / "staging"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_no_commit_before_staged_and_the_bytes_are_those_copied(daemon):
    big = np.arange(3 << 18, dtype=np.float32)  # 3 MiB: a staging file of its own
    copier = HeldCopier()
    with tierckpt.Client(daemon.address) as c:
        fut = c.save("held", 1, 0, 1, {"big": _deferred(big), "small": b"abc"}, copier=copier)
        assert copier.started.wait(30)
        time.sleep(0.3)  # the commit thread had every chance to commit early
        assert not fut.staged.done() and not fut.done()
        assert c.latest("held") is None and c.list("held") == []
        copier.go.set()
        fut.wait_staged(30)
        res = fut.result(30)
        assert res.nbytes == big.nbytes + 3 and copier.copies == 1
        ck = c.restore("held", 0)
        assert np.array_equal(ck.shards["big"], big) and ck.shards["small"].tobytes() == b"abc"
        ck.close()


@pytest.mark.parametrize("error, typed", [(RuntimeError("device lost"), tierckpt.InternalError),
                                          (OSError(errno.ENOSPC, "no space"), tierckpt.CapacityError)])
def test_a_failed_copy_fails_the_future_and_aborts_the_save(daemon, error, typed):
    arr = np.ones(1 << 20, dtype=np.uint8)
    copier = HeldCopier(error)
    with tierckpt.Client(daemon.address) as c:
        fut = c.save("fail", 5, 0, 1, {"a": _deferred(arr)}, copier=copier)
        assert len(_staging_left(daemon)) == 1  # begun: its staging directory exists
        copier.go.set()
        with pytest.raises(typed):
            fut.staged.result(30)
        with pytest.raises(typed):
            fut.result(30)
        assert c.list("fail") == [] and c.latest("fail") is None
        assert _staging_left(daemon) == []  # aborted on the daemon: nothing half-committed
        again = c.save("fail", 5, 0, 1, {"a": _deferred(arr * 2)})  # the same step saves cleanly
        again.result(30)
        ck = c.restore("fail", 0)
        assert np.array_equal(ck.shards["a"], arr * 2)
        ck.close()


def test_staged_resolves_before_the_future(daemon):
    order: list[str] = []
    copier = HeldCopier()
    arr = np.arange(1 << 18, dtype=np.int64)
    with tierckpt.Client(daemon.address) as c:
        fut = c.save("order", 2, 0, 1, {"a": _deferred(arr)}, copier=copier)
        fut.staged.add_done_callback(lambda f: order.append("staged"))
        fut.add_done_callback(lambda f: order.append("committed"))
        copier.go.set()
        fut.result(30)
    assert order == ["staged", "committed"]


def test_plain_buffers_are_staged_when_save_returns(daemon):
    with tierckpt.Client(daemon.address) as c:
        fut = c.save("plain", 1, 0, 1, {"a": np.arange(10), "b": b"x" * (2 << 20)})
        assert fut.staged.done() and fut.staged.exception() is None
        fut.result(30)


def test_streamed_save_copies_deferred_shards_at_once(daemon):
    arr = np.arange(1 << 18, dtype=np.float64)
    with tierckpt.Client(daemon.address, transfer="stream") as c:
        fut = c.save("stream", 1, 0, 1, {"a": _deferred(arr)})
        assert fut.staged.done()
        fut.result(30)
        ck = c.restore("stream", 0)
        assert np.array_equal(ck.shards["a"], arr)
        ck.close()


# ---------------------------------------------------------------------- the torch Checkpointer

torch = pytest.importorskip("torch")


class HeldTensorCopier:
    """Wraps a Checkpointer's TensorCopier: holds its copies until ``go``."""

    def __init__(self, inner) -> None:
        self.inner, self.go, self.started = inner, threading.Event(), threading.Event()

    def mark(self, sources):
        return self.inner.mark(sources)

    def copy(self, mark, pairs, io):
        self.started.set()
        assert self.go.wait(60), "the test never let the copy go"
        self.inner.copy(mark, pairs, io)

    def host_copy(self, source):
        return self.inner.host_copy(source)

    def close(self):
        self.inner.close()


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512))  # 1 MiB weight
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _train(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()


def test_checkpointer_returns_before_the_copy_and_the_optimizer_step_waits(daemon):
    model, opt = _model_and_opt()
    _train(model, opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    from tierckpt.torch import Checkpointer

    with Checkpointer("ck", address=daemon.address) as ck:
        held = ck._copier = HeldTensorCopier(ck._copier)
        t0 = time.perf_counter()
        fut = ck.save(1, {"model": model, "optim": opt})
        assert held.started.wait(30) and not fut.staged.done()  # save() did not wait for the copy
        assert time.perf_counter() - t0 < 30
        model(torch.randn(8, 512))  # forward (BatchNorm statistics change): small tensors were copied in save()
        stepped = threading.Event()
        trainer = threading.Thread(target=lambda: (_train(model, opt), stepped.set()))
        trainer.start()
        assert not stepped.wait(0.5), "the optimizer step ran before the save was staged"
        assert not fut.done()
        held.go.set()
        assert stepped.wait(30)  # the step ran once staged
        trainer.join(30)
        assert fut.staged.done() and ck._waiter.waits >= 1
        fut.result(30)
        got = ck.read(1).state["model"]
        for k, v in want.items():  # the bytes of save() time, not those of the step after it
            assert torch.equal(got[k], v), k
        assert not torch.equal(model[0].weight.detach(), want["0.weight"])  # the step did run


def test_checkpointer_failed_copy_fails_the_future_and_training_goes_on(daemon):
    model, opt = _model_and_opt()
    from tierckpt.torch import Checkpointer

    class Broken(HeldTensorCopier):
        def copy(self, mark, pairs, io):
            raise RuntimeError("copy engine fault")

    with Checkpointer("ckfail", address=daemon.address) as ck:
        ck._copier = Broken(ck._copier)
        fut = ck.save(1, {"model": model, "optim": opt})
        with pytest.raises(tierckpt.InternalError, match="copy engine fault"):
            fut.result(30)
        _train(model, opt)  # the pre-step wait does not raise: the future carries the failure
        ck.wait()
        assert ck.stats.failed == 1 and ck.stats.committed == 0
        assert ck.client.list("ckfail") == []


def _held_step(model, opt, held, what: str) -> None:
    """The next optimizer step waits while the copy is held, and runs once it is let go."""
    stepped = threading.Event()
    trainer = threading.Thread(target=lambda: (_train(model, opt), stepped.set()))
    trainer.start()
    assert not stepped.wait(0.5), f"{what}: the optimizer step ran before the save was staged"
    held.go.set()
    assert stepped.wait(30), f"{what}: the optimizer step never ran"
    trainer.join(30)


def test_checkpoint_manager_waits_at_the_optimizer_step_not_in_save(daemon):
    from tierckpt.manager import CheckpointManager

    model, opt = _model_and_opt()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager("mgr", address=daemon.address) as mgr:
        held = mgr._checkpointer()._copier = HeldTensorCopier(mgr._checkpointer()._copier)
        fut = mgr.save(1, {"model": model, "optim": opt})
        assert held.started.wait(30) and not fut.staged.done()  # save() returned during the copy
        _held_step(model, opt, held, "CheckpointManager")
        fut.result(30)
        got = mgr.restore({"model": torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512)),
                           "optim": None}, strict=False)
        assert got is not None and got.step == 1
        for k, v in want.items():
            assert torch.equal(got.state["model"].state_dict()[k], v), k


def test_lightning_checkpoint_io_waits_at_the_optimizer_step_not_in_save(daemon, tmp_path):
    pytest.importorskip("lightning_fabric", reason="the lightning extra is not installed")
    from tierckpt.lightning import TierckptCheckpointIO

    model, opt = _model_and_opt()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    io = TierckptCheckpointIO("lt", address=daemon.address)
    held = io.checkpointer._copier = HeldTensorCopier(io.checkpointer._copier)
    path = str(tmp_path / "step=1.ckpt")
    io.save_checkpoint({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                        "global_step": 1}, path)
    assert held.started.wait(30)  # save_checkpoint returned during the copy
    _held_step(model, opt, held, "Lightning")
    got = io.load_checkpoint(path)  # waits for the commit and the pointer
    io.teardown()
    for k, v in want.items():
        assert torch.equal(got["state_dict"][k], v), k


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls (address -> size registered now)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.registers = 0

    def cudaHostRegister(self, ptr, size, flags):
        assert ptr not in self.held, "registered twice"
        self.held[ptr] = size
        self.registers += 1
        return 0

    def cudaHostUnregister(self, ptr):
        assert self.held.pop(ptr, None) is not None, "unregistering what is not registered"
        return 0


def test_page_locked_staging_maps_are_registered_once_and_unregistered_before_unmapping(tmp_path):
    """The registration lifecycle of TensorCopier (no GPU: the runtime calls are recorded): a kept
    map is page-locked once and reused by later saves; every map is unregistered before it is
    unmapped (a save's own maps at its commit or abort, kept maps when they age out), and close()
    unregisters the rest."""
    from tierckpt._staging import Destinations
    from tierckpt._tensorcopy import TensorCopier
    from tierckpt._transfer import StagingMaps

    fake = FakeCudart()
    copier = TensorCopier()
    copier._cudart = lambda: fake
    kept = StagingMaps(keep=1)
    files = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes(1 << 20))
        files.append(str(p))

    def save(recycled_path: str, own_path: str) -> Destinations:
        kept.new_save()
        dests = Destinations(kept)
        for path, recycled in ((recycled_path, True), (own_path, False)):
            assert copier._page_locked(fake, dests.open(path, path, 1 << 20, recycled), [])
        return dests

    first = save(files[0], files[1])
    assert fake.registers == 2 and len(fake.held) == 2
    first.close()  # committed: its own map is unregistered, then unmapped; the kept one stays locked
    assert fake.registers == 2 and len(fake.held) == 1
    second = save(files[0], files[2])  # the kept map again: not registered a second time
    assert fake.registers == 3 and len(fake.held) == 2
    second.close()
    assert len(fake.held) == 1
    for _ in range(3):
        kept.new_save()
    kept.trim()  # the kept map aged out: unregistered before it is unmapped
    assert fake.held == {}
    third = save(files[1], files[2])
    third.close()
    assert len(fake.held) == 1
    copier.close()
    assert fake.held == {}
    kept.close()


def test_a_held_save_commits_only_when_told_and_close_aborts_the_ones_still_held(daemon):
    data = np.arange(1 << 18, dtype=np.float32)
    with tierckpt.Client(daemon.address) as c:
        fut = c.save("held", 1, 0, 1, {"w": Deferred(data, data.nbytes, data.dtype.str, data.shape)},
                     metadata={"v": 1}, hold=True)
        fut.wait_staged(60)
        time.sleep(0.3)
        assert not fut.done() and c.availability("held", 0) == []  # staged, not committed
        assert fut.commit(metadata={"v": 2}).result(60).nbytes == data.nbytes
        with pytest.raises(tierckpt.errors.FailedPreconditionError):
            fut.commit()
        with c.restore("held", 0, 1) as ck:
            assert ck.metadata == {"v": 2} and np.array_equal(ck.shards["w"], data)
        gone = c.save("held", 2, 0, 1, {"w": data}, hold=True)
        gone.abort(tierckpt.errors.FailedPreconditionError("not this one"))
        with pytest.raises(tierckpt.errors.FailedPreconditionError, match="not this one"):
            gone.result(60)
        left = c.save("held", 3, 0, 1, {"w": data}, hold=True)
    with pytest.raises(tierckpt.errors.FailedPreconditionError, match="closed"):
        left.result(60)
    with tierckpt.Client(daemon.address) as c:
        assert [a.step for a in c.availability("held", 0)] == [1]
