"""CheckpointManager.restore is strict for every state kind (raw, torch, JAX): a key missing on
either side, or a shape or dtype that differs, is an InvalidArgumentError naming the key path
(expected: the state's; stored: the checkpoint's), raised before the state is touched;
strict=False fills what matches. max_to_keep takes an int as Orbax's does. Real daemon."""

from __future__ import annotations

import numpy as np
import pytest
import tierckpt
from tierckpt.manager import CheckpointManager


def _raw_saved(daemon, job):
    mgr = CheckpointManager(job, address=daemon.address, async_=False, raise_on_error=True)
    mgr.save(1, {"w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.int64), "tag": b"x"}, force=True)
    return mgr


@pytest.mark.parametrize("target, named", [
    ({"w": np.zeros(6, np.float32), "b": np.zeros(2, np.int64)}, "not in the state: tag"),
    ({"w": np.zeros(6, np.float32), "b": np.zeros(2, np.int64), "tag": b"", "new": np.zeros(1)},
     "missing in the checkpoint: new"),
    ({"w": np.zeros(7, np.float32), "b": np.zeros(2, np.int64), "tag": b""},
     "w: expected float32[7], stored float32[6]"),
    ({"w": np.zeros(6, np.float64), "b": np.zeros(2, np.int64), "tag": b""},
     "w: expected float64[6], stored float32[6]"),
    ({"w": np.zeros(6, np.float32), "b": np.zeros(2, np.int64), "tag": np.zeros(1, np.uint8)},
     "tag: expected uint8[1], stored bytes"),
])
def test_raw_mismatch_names_the_key_and_changes_nothing(daemon, target, named):
    with _raw_saved(daemon, "strict-raw") as mgr:
        before = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in target.items()}
        with pytest.raises(tierckpt.InvalidArgumentError, match="state: does not match strict-raw step 1") as e:
            mgr.restore(target)
        assert named in str(e.value)
        assert target.keys() == before.keys()
        for k, v in before.items():
            assert np.array_equal(target[k], v) if isinstance(v, np.ndarray) else target[k] == v


def test_raw_strict_false_is_lenient_and_match_fills_in_place(daemon):
    with _raw_saved(daemon, "strict-raw2") as mgr:
        loose = {"w": np.zeros(7, np.float32), "keep": np.full(1, 5.0)}
        got = mgr.restore(loose, strict=False)
        assert got.state is loose and loose["w"].shape == (6,) and loose["tag"] == b"x" and loose["keep"][0] == 5
        exact = {"w": np.zeros(6, np.float32), "b": np.zeros(2, np.int64), "tag": b""}
        buf = exact["w"]
        mgr.restore(exact)
        assert exact["w"] is buf and np.array_equal(buf, np.arange(6, dtype=np.float32)) and exact["tag"] == b"x"


def test_torch_mismatch_names_the_key_path(daemon):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager("strict-torch", address=daemon.address, async_=False, raise_on_error=True) as mgr:
        mgr.save(1, {"model": model, "optim": opt, "extra": {"epoch": 2, "ema": torch.zeros(3)}}, force=True)
        wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
        w0 = wider[0].weight.detach().clone()
        cases = [
            ({"model": wider, "optim": torch.optim.SGD(wider.parameters(), lr=0.1), "extra": {"epoch": 0}},
             ["model.0.weight: expected float32[5, 3], stored float32[4, 3]", "not in the state: extra.ema"]),
            ({"model": torch.nn.Sequential(torch.nn.Linear(3, 4)), "extra": {"epoch": 0, "ema": torch.zeros(3)}},
             ["not in the state: optim, model.1.weight, model.1.bias"]),
            ({"model": model, "optim": opt, "extra": {"epoch": 0, "ema": torch.zeros(3, dtype=torch.float64)},
              "sched": {"last": 1}}, ["missing in the checkpoint: sched", "extra.ema: expected float64[3], stored "
                                                                         "float32[3]"]),
        ]
        for state, named in cases:
            with pytest.raises(tierckpt.InvalidArgumentError) as e:
                mgr.restore(state)
            for n in named:
                assert n in str(e.value), (n, str(e.value))
        assert torch.equal(wider[0].weight, w0)  # nothing was loaded
        state = {"model": model, "optim": opt, "extra": {"epoch": 0, "ema": torch.ones(3)}}
        got = mgr.restore(state)  # a fresh optimizer (no state yet) is fine: its own load_state_dict checks
        assert got.step == 1 and state["extra"]["epoch"] == 2 and torch.equal(state["extra"]["ema"], torch.zeros(3))
        partial = {"model": model}
        assert mgr.restore(partial, strict=False).step == 1  # opts out: the keys the state has are loaded
        assert list(partial) == ["model"]


def test_jax_mismatch_names_the_leaf(daemon):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with CheckpointManager("strict-jax", address=daemon.address, async_=False, raise_on_error=True) as mgr:
        mgr.save(1, {"a": jnp.ones((2, 3)), "b": [jnp.zeros(4)]}, force=True)
        with pytest.raises(tierckpt.InvalidArgumentError, match=r"missing in the checkpoint: \['c'\]; "
                                                                  r"not in the target: \['b'\]\[0\]"):
            mgr.restore({"a": jnp.ones((2, 3)), "c": jnp.ones(4)})
        with pytest.raises(tierckpt.InvalidArgumentError, match=r"leaf \['a'\]: expected float32\[3, 2\], "
                                                                  r"stored float32\[2, 3\]"):
            mgr.restore({"a": jax.ShapeDtypeStruct((3, 2), jnp.float32), "b": [jnp.zeros(4)]})
        got = mgr.restore({"a": jax.ShapeDtypeStruct((3, 2), jnp.float32), "b": [jnp.zeros(4)]}, strict=False)
        assert got.state["a"].shape == (2, 3)


def test_max_to_keep_int_as_orbax(daemon):
    with CheckpointManager("keep-int", address=daemon.address, max_to_keep=1, async_=False,
                           raise_on_error=True) as mgr:
        assert mgr.max_to_keep == {"local": 1, "persistent": 1}
        for step in (1, 2):
            mgr.save(step, {"w": np.ones(4, np.float32)}, force=True)
        assert mgr.all_steps() == [2]
        assert mgr.client.get_job_policy("keep-int")[0] == tierckpt.JobPolicy(keep_local=1, keep_persistent=1)
    for bad in (0, True, "3", 2.5):
        with pytest.raises(tierckpt.InvalidArgumentError, match="max_to_keep"):
            CheckpointManager("keep-int", address=daemon.address, max_to_keep=bad)
