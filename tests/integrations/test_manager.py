"""tierckpt.CheckpointManager through a real daemon: intervals, formats, failures, agreement."""

from __future__ import annotations

import numpy as np
import pytest
import tierckpt
from tierckpt import goodput
from tierckpt.manager import CheckpointManager


def test_fixed_interval_and_persist_every(daemon):
    with CheckpointManager("mgr", address=daemon.address, policy=2, persist_every=4) as mgr:
        assert [mgr.should_save(s) for s in range(6)] == ["local", None, "local", None, "persistent", None]
        futs = {s: mgr.save(s, {"w": np.full(8, s, np.float32), "blob": b"step%d" % s}) for s in range(1, 6)}
        assert [s for s, f in futs.items() if f is not None] == [2, 4]
        assert mgr.save(5, {"w": np.zeros(8, np.float32)}, force=True) is not None
        mgr.wait_until_finished()
        assert mgr.stats.committed == 3 and mgr.stats.failed == 0 and mgr.stats.skipped == 3
        assert mgr.all_steps() == [4, 5]  # no max_to_keep given: the daemon's keep_local (2) applies
        assert mgr.latest_step() == 5
        target = {"w": np.empty(8, np.float32), "blob": b""}
        buf = target["w"]
        got = mgr.restore(target, step=4)
        assert got.step == 4 and got.state is target and target["w"] is buf  # filled in place
        assert np.array_equal(buf, np.full(8, 4, np.float32)) and target["blob"] == b"step4"
        fresh = mgr.restore()
        assert fresh.step == 5 and fresh.state["w"].flags.writeable


def test_goodput_policy_intervals(daemon):
    plan = goodput.evaluate(
        [goodput.TierCost("local", 0.1, 1), goodput.TierCost("persistent", 10, 60)],
        goodput.FailureModel(3600, 0.5, 0.3, 0.2), {"local": 3, "persistent": 9}, step_time_s=1)
    mgr = CheckpointManager("mgrplan", address=daemon.address, policy=goodput.Policy(plan))
    assert [s for s in range(1, 19) if mgr.should_save(s)] == [3, 6, 9, 12, 15, 18]
    assert mgr.should_save(9) == "persistent" and mgr.should_save(6) == "local"
    mgr.close()


def test_nothing_to_restore(daemon):
    with CheckpointManager("empty", address=daemon.address) as mgr:
        assert mgr.latest_step() is None and mgr.restore() is None and mgr.all_steps() == []
        with pytest.raises(tierckpt.NotFoundError):
            mgr.restore(step=3)


def test_failures_counted_not_raised(daemon):
    mgr = CheckpointManager("down", address=daemon.address, policy=1)
    assert mgr.save(1, {"w": np.ones(4)}) is not None
    mgr.wait_until_finished()
    daemon.kill()
    fut = mgr.save(2, {"w": np.ones(4)})  # the daemon is gone: no exception into the loop
    assert fut is not None and isinstance(fut.exception(timeout=30), tierckpt.UnavailableError)
    mgr.wait_until_finished()
    assert mgr.stats.committed == 1 and mgr.stats.failed == 1 and "Unavailable" in mgr.stats.last_error
    mgr.close()
    strict = CheckpointManager("down", address=daemon.address, raise_on_error=True)
    with pytest.raises(tierckpt.UnavailableError):
        strict.save(3, {"w": np.ones(4)})
    assert strict.stats.failed == 1
    strict.close()


def test_bad_state_is_the_callers_bug(daemon):
    with CheckpointManager("bad", address=daemon.address, format="raw") as mgr:
        with pytest.raises(tierckpt.InvalidArgumentError):
            mgr.save(1, {"w": [1, 2, 3]})
    with pytest.raises(tierckpt.InvalidArgumentError):
        CheckpointManager("bad", address=daemon.address, policy=0)
    with pytest.raises(tierckpt.InvalidArgumentError):
        CheckpointManager("bad", address=daemon.address, max_to_keep={"disk": 1})


def test_torch_state_in_place(daemon):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optim": opt, "extra": {"epoch": 3}}
    with CheckpointManager("tmgr", address=daemon.address, async_=False) as mgr:
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        fut = mgr.save(1, state, metadata={"lr": 0.1})
        assert fut.done() and fut.exception() is None  # async_=False: committed on return
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        ptr = model.weight.data_ptr()
        with torch.no_grad():
            model.weight.zero_()
        got = mgr.restore(state)
        assert got.step == 1 and got.metadata == {"lr": 0.1} and state["extra"] == {"epoch": 3}
        assert model.weight.data_ptr() == ptr and torch.equal(model.weight, saved["weight"])
        assert opt.state_dict()["state"][0]["momentum_buffer"] is not None
        assert torch.equal(mgr.restore().state["model"]["bias"], saved["bias"])  # no target: the state dicts


def test_two_ranks_agree_on_the_newest_common_step(daemon_factory):
    """Rank 1 lost its newest save: the ranks agree (gloo) on the newest step both hold."""
    import os
    import subprocess
    import sys

    d = daemon_factory()
    script = os.path.join(os.path.dirname(__file__), "_agree_worker.py")
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "TIERCKPT_ADDRESS": d.address}
    procs = [subprocess.Popen([sys.executable, script, str(r), "2"], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs == ["agreed 2", "agreed 2"]


def _free_port() -> int:
    from tierckptd.testing import free_port

    return free_port()


def test_steps_due_in_the_persistent_tier_are_persisted(daemon_factory, tmp_path):
    d = daemon_factory(args=("--persistent", f"file://{tmp_path}/bucket"))
    with CheckpointManager("pers", address=d.address, policy=1, persist_every=2) as mgr:
        f1 = mgr.save(1, {"w": np.ones(4)})
        f2 = mgr.save(2, {"w": np.ones(4) * 2})
        assert f2.wait("persistent", timeout=30)
        with pytest.raises(tierckpt.TierError, match="not selected"):
            f1.wait("persistent", timeout=10)  # not due: saved without persist, the daemon's persist_every is 0


def test_raise_on_error_raises_at_once_for_torch_states_too(daemon):
    import torch
    mgr = CheckpointManager("tdown", address=daemon.address, raise_on_error=True)
    daemon.kill()
    with pytest.raises(tierckpt.UnavailableError):
        mgr.save(1, {"model": torch.nn.Linear(2, 2)})
    assert mgr.stats.failed == 1
    mgr.close()
    assert mgr.stats.failed == 1  # counted once


def test_max_to_keep_is_enforced_through_the_job_policy(daemon):
    from tierckpt import CheckpointManager, JobPolicy

    with CheckpointManager("mtk", address=daemon.address, max_to_keep={"local": 1, "persistent": 3},
                           async_=False, raise_on_error=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.arange(8, dtype=np.float32)}, force=True)
        assert [i.step for i in mgr.client.list("mtk")] == [3]
        assert mgr.client.get_job_policy("mtk")[0] == JobPolicy(keep_local=1, keep_persistent=3)
