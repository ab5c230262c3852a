"""JAX pytrees through a real daemon: structure, dtypes (bfloat16 included) and placement round-trip."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tierckpt
from tierckpt import jax as tjax


class Adam(NamedTuple):
    count: jax.Array
    mu: dict
    nu: dict


def make_state(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {"dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jnp.zeros(3, jnp.bfloat16)},
              "emb": [jax.random.normal(k2, (5, 2), jnp.float16), jnp.arange(6, dtype=jnp.int32).reshape(2, 3)]}
    opt = Adam(jnp.asarray(7, jnp.int32), jax.tree_util.tree_map(jnp.ones_like, params),
               jax.tree_util.tree_map(jnp.zeros_like, params))
    return {"params": params, "opt": opt, "step": 7, "name": "run-a", "empty": jnp.zeros((0, 4))}


def same(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        (np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y)))
        if hasattr(x, "dtype") else x == y for x, y in zip(la, lb))


def test_roundtrip_into_target_structure(daemon):
    state = make_state(0)
    with daemon.client() as c:
        tjax.save_pytree(c, "jx", 7, state, metadata={"note": 1}).result()
        target = make_state(1)  # same structure, other values
        got = tjax.restore_pytree(c, "jx", target=target)
        assert same(got, state)
        assert isinstance(got["opt"], Adam) and got["params"]["dense"]["bias"].dtype == jnp.bfloat16
        assert isinstance(got["params"]["emb"][0], jax.Array)
        assert got["params"]["emb"][0].sharding == target["params"]["emb"][0].sharding
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape")
                                          else x, target)
        assert same(tjax.restore_pytree(c, "jx", target=abstract), state)
        plain = tjax.restore_pytree(c, "jx")  # no target: nested dicts and lists from the key paths
        assert plain["opt"]["mu"]["emb"][1].tolist() == [[1, 1, 1], [1, 1, 1]]
        assert plain["name"] == "run-a" and plain["step"] == 7
        assert np.array_equal(plain["params"]["dense"]["kernel"], state["params"]["dense"]["kernel"])


def test_mismatched_target_is_refused(daemon):
    with daemon.client() as c:
        tjax.save_pytree(c, "jx2", 1, {"w": jnp.ones((2, 2))}).result()
        with pytest.raises(tierckpt.InvalidArgumentError, match="float32"):
            tjax.restore_pytree(c, "jx2", target={"w": jnp.ones((3, 2))})
        with pytest.raises(tierckpt.InvalidArgumentError,
                           match=r"missing in the checkpoint: \[.v.\]; not in the target: \[.w.\]"):
            tjax.restore_pytree(c, "jx2", target={"v": jnp.ones((2, 2))})
        with pytest.raises(tierckpt.InvalidArgumentError, match="object"):
            tjax.save_pytree(c, "jx2", 2, {"w": jnp.ones(2), "f": object()})


def test_manager_with_a_jax_train_loop(daemon):
    """A manager-driven loop, interrupted and resumed, ends bit-identical to an uninterrupted one."""

    @jax.jit
    def step_fn(params, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)

    xs = jax.random.normal(jax.random.PRNGKey(3), (10, 4, 3))
    init = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}

    def run(mgr, stop: int | None):
        restored = mgr.restore(init)
        params, start = (restored.state, restored.step + 1) if restored else (init, 1)
        for s in range(start, 11):
            if s == stop:
                return None
            params = step_fn(params, xs[s - 1])
            mgr.save(s, params)
        mgr.wait_until_finished()
        return params

    with tierckpt.CheckpointManager("jloop", address=daemon.address, policy=3) as mgr:
        assert run(mgr, stop=8) is None
        mgr.wait_until_finished()  # the crash came after step 6's commit
        assert mgr.all_steps() == [3, 6] and mgr.stats.committed == 2
        resumed = run(mgr, stop=None)
    with tierckpt.CheckpointManager("jref", address=daemon.address, policy=100) as ref:
        straight = run(ref, stop=None)
    assert same(resumed, straight)
