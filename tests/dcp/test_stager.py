"""tierckpt.dcp.Stager: dcp.async_save staging that returns before the copy, one process, real daemon.

- ``stage()`` returns before the copy (the staging thread is held) and the staged copy holds the
  bytes of ``stage()`` time even though the optimizer steps right after (the pre-step hook waits);
- a plain tensor, a nested dict and a non-tensor value round-trip through the Writer and Reader.

Bound to its Writer (``Writer(job, step, stager=stager)``, issue 31: one host copy):

- ``dcp.async_save`` then ``dcp.load`` gives the exact bytes (large and packed tensors, a DTensor-free
  nested state, a non-tensor value), and tensors changed after ``staging_completion`` do not change
  what was saved;
- one host copy: every large tensor is copied once, from the live tensor's memory straight into a
  staging mapping of the daemon's local dir; ``write_data`` resolves no item (it reads no tensor
  byte), and the staged state DCP gets is the live state (no host copy of it is kept);
- a failed copy fails ``staging_completion`` and the upload, and commits nothing;
- a stager bound to a Writer whose save is in flight refuses a second Writer, and takes one once
  that save committed; a bound Writer does not pickle (no PROCESS executor);
- a ``checkpoint_id`` naming another step than the bound Writer's fails the save (staging began
  before DCP applied it) and commits nothing.
"""

from __future__ import annotations

import mmap
import threading

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import tierckpt  # noqa: E402
import tierckpt.dcp as tdcp  # noqa: E402


def test_async_save_with_the_stager_saves_the_bytes_of_stage_time(daemon):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stager = tdcp.Stager()
    gate = threading.Event()
    held = stager._copy

    def slow_copy(*a):
        assert gate.wait(60)
        return held(*a)

    stager._copy = slow_copy
    with tierckpt.Client(daemon.address) as c:
        sd = {"model": model.state_dict(), "extra": {"epoch": 3, "t": torch.arange(5)}}
        resp = dcp.async_save(sd, storage_writer=tdcp.Writer("stg", 1, client=c), async_stager=stager, no_dist=True)
        staging = getattr(resp, "staging_completion", None)
        assert staging is not None and not staging.done()  # async_save returned before the copy
        stepped = threading.Event()

        def step() -> None:
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            stepped.set()

        trainer = threading.Thread(target=step)
        trainer.start()
        assert not stepped.wait(0.5), "the optimizer step ran before staging finished"
        gate.set()
        assert stepped.wait(30)
        trainer.join(30)
        resp.upload_completion.result(60)
        got = {"model": {k: torch.zeros_like(v) for k, v in before.items()},
               "extra": {"epoch": 0, "t": torch.zeros(5, dtype=torch.int64)}}
        dcp.load(got, storage_reader=tdcp.Reader("stg", 1, client=c), no_dist=True)
    stager.close()
    for k, v in before.items():
        assert torch.equal(got["model"][k], v), k
    assert not torch.equal(model.weight.detach(), before["weight"])
    assert got["extra"]["epoch"] == 3 and torch.equal(got["extra"]["t"], torch.arange(5))


# ------------------------------------------------------------------------- bound: one host copy


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"big": torch.randn(512, 1024, generator=g),  # 2 MiB: its own shard
                      "mid": torch.randn(64, 1024, generator=g),  # 256 KiB: copied in stage()
                      "small": torch.randn(16, generator=g),  # packed
                      "ints": torch.arange(300_000, dtype=torch.int64)},  # 2.4 MiB, another dtype
            "extra": {"epoch": 7, "name": "run"}}


def _zeros_like(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "extra": {"epoch": 0, "name": ""}}


class _CountingPlanner(dcp.DefaultSavePlanner):
    resolved = 0

    def resolve_data(self, write_item):
        type(self).resolved += 1
        return super().resolve_data(write_item)


def test_bound_stager_saves_the_bytes_of_stage_time_in_one_copy_into_the_staging_mappings(daemon, monkeypatch):
    import tierckpt._tensorcopy as tc

    copies: list[tuple[int, int, object]] = []  # (source address, bytes, destination's base) per host copy
    real = tc.copy_host

    def spy(pairs, io, as_bytes):
        for src, dst in pairs:
            copies.append((src.data_ptr(), dst.nbytes, getattr(dst.base, "obj", dst.base)))
        return real(pairs, io, as_bytes)

    monkeypatch.setattr(tc, "copy_host", spy)
    sd = _state()
    want = {k: v.clone() for k, v in sd["model"].items()}
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        w = tdcp.Writer("bound", 1, client=c, stager=stager)
        assert stager.bound
        _CountingPlanner.resolved = 0
        resp = dcp.async_save(sd, storage_writer=w, async_stager=stager, planner=_CountingPlanner(), no_dist=True)
        staged_sd = resp.staging_completion.result(60) or None
        for v in sd["model"].values():
            v.add_(1)  # staged: the tensors may change
        sd["extra"]["epoch"] = 8
        resp.upload_completion.result(60)
        got = _zeros_like(sd)
        dcp.load(got, storage_reader=tdcp.Reader("bound", 1, client=c), no_dist=True)
    stager.close()
    for k, v in want.items():
        assert torch.equal(got["model"][k], v), k
    assert got["extra"] == {"epoch": 7, "name": "run"}
    assert _CountingPlanner.resolved == 0  # write_data read no item: the bytes came from the staging files
    big = {k: v for k, v in sd["model"].items() if k in ("big", "ints")}
    for k, v in big.items():
        mine = [(n, base) for addr, n, base in copies if addr == v.data_ptr()]
        assert len(mine) == 1, (k, mine)  # one copy, from the live tensor itself
        n, base = mine[0]
        assert n == v.numel() * v.element_size() and isinstance(base, mmap.mmap)  # into a staging mapping
    assert staged_sd is None  # DCP's staging_completion carries no state copy
    assert w._staged is None and w._writing.done()


def test_bound_stager_future_resolves_to_the_live_state_not_a_copy(daemon):
    sd = _state(1)
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        w = tdcp.Writer("live", 1, client=c, stager=stager)
        fut = stager.stage(sd)
        assert fut.result(60) is sd  # no host copy of the state is kept: the bytes are in the staging files
        staged = w._staged
        assert staged is not None and not staged.save.done()  # held: nothing commits before write_data
        staged.save.staged.result(60)  # copied into the staging files
        stager.drop_staged()
        with pytest.raises(tierckpt.errors.FailedPreconditionError):
            staged.save.result(60)
        assert c.availability("live", 0) == []
    stager.close()


def test_bound_stager_copy_failure_fails_the_save_and_commits_nothing(daemon, monkeypatch):
    import tierckpt._tensorcopy as tc

    def broken(pairs, io, as_bytes):
        raise OSError(5, "injected copy failure")

    monkeypatch.setattr(tc, "copy_host", broken)
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        w = tdcp.Writer("broken", 1, client=c, stager=stager)
        resp = dcp.async_save(_state(), storage_writer=w, async_stager=stager, no_dist=True)
        with pytest.raises(Exception, match="injected copy failure"):
            resp.upload_completion.result(60)
        # (DCP's staging_completion reports a stage future that failed before async_save returned as done)
        with pytest.raises(tierckpt.errors.TierckptError, match="injected copy failure"):
            stager._last.result(60)
        assert c.availability("broken", 0) == [] and c.availability("broken", 1) == []
        with pytest.raises(tierckpt.errors.NotFoundError, match="no tierckpt.dcp checkpoint"):
            tdcp.Reader("broken", client=c).read_metadata()
        monkeypatch.undo()
        assert w._staged is None  # the failed save released the binding
        w2 = tdcp.Writer("broken", 2, client=c, stager=stager)
        dcp.async_save(_state(), storage_writer=w2, async_stager=stager, no_dist=True).upload_completion.result(60)
        assert [a.step for a in c.availability("broken", 0)] == [2]
    stager.close()


def test_a_bound_stager_refuses_a_second_writer_while_the_first_save_is_in_flight(daemon, monkeypatch):
    import tierckpt._tensorcopy as tc

    gate = threading.Event()
    real = tc.copy_host

    def held(pairs, io, as_bytes):
        assert gate.wait(60)
        return real(pairs, io, as_bytes)

    monkeypatch.setattr(tc, "copy_host", held)
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        w1 = tdcp.Writer("two", 1, client=c, stager=stager)
        resp = dcp.async_save(_state(), storage_writer=w1, async_stager=stager, no_dist=True)
        with pytest.raises(tierckpt.errors.FailedPreconditionError, match="in flight"):
            tdcp.Writer("two", 2, client=c, stager=stager)
        gate.set()
        resp.upload_completion.result(60)
        w2 = tdcp.Writer("two", 2, client=c, stager=stager)  # the first save committed: free again
        dcp.async_save(_state(), storage_writer=w2, async_stager=stager, no_dist=True).upload_completion.result(60)
        with pytest.raises(tierckpt.errors.FailedPreconditionError, match="another process"):
            import pickle

            pickle.dumps(w2)
    stager.close()
    with tierckpt.Client(daemon.address) as c:
        assert sorted(a.step for a in c.availability("two", 0)) == [1, 2]


def test_an_unbound_stager_still_works_with_a_bound_writer_elsewhere(daemon):
    sd = _state(2)
    want = {k: v.clone() for k, v in sd["model"].items()}
    bound, plain = tdcp.Stager(), tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        tdcp.Writer("other", 1, client=c, stager=bound)
        resp = dcp.async_save(sd, storage_writer=tdcp.Writer("plain", 1, client=c), async_stager=plain, no_dist=True)
        resp.upload_completion.result(60)
        got = _zeros_like(sd)
        dcp.load(got, storage_reader=tdcp.Reader("plain", 1, client=c), no_dist=True)
    bound.close()
    plain.close()
    assert not plain.bound
    for k, v in want.items():
        assert torch.equal(got["model"][k], v), k


def test_a_checkpoint_id_other_than_the_bound_writers_fails_the_save_and_commits_nothing(daemon):
    stager = tdcp.Stager()
    with tierckpt.Client(daemon.address) as c:
        w = tdcp.Writer("idm", 1, client=c, stager=stager)
        resp = dcp.async_save(_state(), checkpoint_id="tierckpt://idm/2", storage_writer=w, async_stager=stager,
                              no_dist=True)
        with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is a BaseException
            resp.upload_completion.result(60)
        assert "give the bound Writer its job and step" in str(getattr(failed.value, "failures", {}).get(0))
        assert c.availability("idm", 0) == []
        w2 = tdcp.Writer("idm", 3, client=c, stager=stager)  # the failed save left the stager free
        dcp.async_save(_state(), storage_writer=w2, async_stager=stager, no_dist=True).upload_completion.result(60)
        assert [a.step for a in c.availability("idm", 0)] == [3]
    stager.close()
