"""Saving and restoring JAX pytrees through the tierckpt daemon.

A pytree (nested dicts, lists, tuples, namedtuples, registered dataclasses...) of arrays is
flattened with :func:`jax.tree_util.tree_flatten_with_path`; every array leaf (``jax.Array`` or
numpy array) becomes one shard of raw bytes, and a small JSON index shard records, per leaf, its
key path, dtype and shape. Non-array leaves that JSON can carry (numbers, strings, None) travel
in the index. ::

    import tierckpt, tierckpt.jax
    with tierckpt.Client() as c:
        tierckpt.jax.save_pytree(c, "job", step, {"params": params, "opt": opt_state}).result()
        state = tierckpt.jax.restore_pytree(c, "job", target=abstract_or_live_state)

Restoring with a ``target`` gives back exactly the target's structure (its treedef), each array
placed like the target's leaf (its sharding for a ``jax.Array``); without one, the structure is
rebuilt as nested dicts and lists from the stored key paths. Dtypes numpy lacks (bfloat16,
float8) round-trip through ``jax.numpy.dtype``.

Limits: every array must be fully addressable by this process (single-host, or replicated);
a multi-host sharded array should be saved per process with its addressable shards by the
caller. No pickle is used: a checkpoint holds only bytes and JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .client import Checkpoint, Client, SaveFuture
from .errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["FORMAT", "INDEX_SHARD", "encode", "decode", "save_pytree", "restore_pytree", "is_pytree_of_arrays"]

FORMAT = "tierckpt.jax/1"
INDEX_SHARD = "pytree.json"


def _keystr(path: list) -> str:
    """A stored key path as ``jax.tree_util.keystr`` writes it: ``['a'][0].b``."""
    return "".join(f"[{v!r}]" if kind == "k" else f"[{v}]" if kind == "i" else f".{v}" for kind, v in path)


def _key_entry(k: Any) -> list:
    """One element of a key path as JSON: ["k", dict key] | ["i", index] | ["a", attribute name]."""
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        if not isinstance(k.key, (str, int)):
            raise InvalidArgumentError(f"state: dict key {k.key!r} is neither str nor int")
        return ["k", k.key]
    if isinstance(k, tu.SequenceKey):
        return ["i", k.idx]
    if isinstance(k, tu.GetAttrKey):
        return ["a", k.name]
    if isinstance(k, tu.FlattenedIndexKey):
        return ["i", k.key]
    raise InvalidArgumentError(f"state: unsupported pytree key {k!r}")


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_pytree_of_arrays(tree: Any) -> bool:
    """True if ``tree`` has at least one ``jax.Array`` leaf."""
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(tree))


def encode(tree: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shards for :meth:`Client.save` and the index of ``tree``.

    Returns:
        (shards, index): ``shards`` maps ``leaf.<i>`` to a host numpy array of raw bytes and
        :data:`INDEX_SHARD` to the JSON index; ``index`` is that JSON as a dict.

    Raises:
        InvalidArgumentError: a leaf is neither an array nor JSON-serialisable, or a key is not
            a str or int.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves: list[dict[str, Any]] = []
    shards: dict[str, Any] = {}
    for i, (path, leaf) in enumerate(flat):
        entry: dict[str, Any] = {"path": [_key_entry(k) for k in path]}
        if _is_array(leaf):
            arr = np.asarray(leaf)  # device -> host for a jax.Array
            arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # ascontiguousarray makes 0-d 1-d
            name = f"leaf.{i}"
            shards[name] = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
            entry.update(shard=name, dtype=arr.dtype.name, shape=list(arr.shape))
        else:
            try:
                json.dumps(leaf, allow_nan=False)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"state: leaf at {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
                    "neither an array nor JSON-serialisable") from None
            entry["value"] = leaf
        leaves.append(entry)
    index = {"format": FORMAT, "leaves": leaves}
    shards[INDEX_SHARD] = json.dumps(index, separators=(",", ":")).encode()
    return shards, index


def _array(ck: Checkpoint, entry: Mapping[str, Any]) -> np.ndarray:
    """A writable host copy of one stored leaf."""
    raw = np.asarray(ck.shards[entry["shard"]]).reshape(-1).view(np.uint8)
    dtype, shape = jnp.dtype(entry["dtype"]), tuple(entry["shape"])
    return raw.view(dtype).reshape(shape).copy() if raw.size else np.empty(shape, dtype)


def _insert(root: dict, path: list, value: Any) -> None:
    node = root
    for (_, key), nxt in zip(path, [*path[1:], None]):
        if nxt is None:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def _listify(node: Any) -> Any:
    """Nested dicts whose keys came from sequence indices back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _place(arr: np.ndarray, like: Any, where: str, strict: bool) -> Any:
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)) and (strict or isinstance(like, jax.Array)):
        if tuple(like.shape) != arr.shape or like.dtype != arr.dtype:
            raise InvalidArgumentError(f"target: leaf {where}: expected {like.dtype}{list(like.shape)}, "
                                       f"stored {arr.dtype}{list(arr.shape)}")
    if isinstance(like, jax.Array):
        return jax.device_put(arr, like.sharding)
    if isinstance(like, jax.ShapeDtypeStruct):
        sharding = getattr(like, "sharding", None)
        return jax.device_put(arr, sharding) if sharding is not None else jnp.asarray(arr)
    if isinstance(like, (np.ndarray, np.generic)):
        return arr
    return jnp.asarray(arr)


def decode(ck: Checkpoint, target: Any = None, *, strict: bool = True) -> Any:
    """The pytree stored in ``ck`` (see the module docstring for ``target``).

    ``strict``: every array leaf of ``target`` (a ``jax.Array``, ``jax.ShapeDtypeStruct`` or
    numpy array) must have the stored shape and dtype; False checks only ``jax.Array`` leaves
    (which are placed with their sharding). The structure is always checked.

    Raises:
        FailedPreconditionError: ``ck`` is not a checkpoint written by :func:`encode`.
        InvalidArgumentError: ``target`` does not match the stored structure, shapes or dtypes.
    """
    if INDEX_SHARD not in ck.shards:
        raise FailedPreconditionError(f"{ck.job} step {ck.step} rank {ck.rank}: not a {FORMAT} checkpoint")
    index = json.loads(np.asarray(ck.shards[INDEX_SHARD]).tobytes())
    if index.get("format") != FORMAT:
        raise FailedPreconditionError(f"{ck.job} step {ck.step}: unknown pytree format {index.get('format')!r}")
    by_path = {json.dumps(e["path"]): e for e in index["leaves"]}
    if target is None:
        root: dict = {}
        for e in index["leaves"]:
            value = _array(ck, e) if "shard" in e else e["value"]
            _insert(root, e["path"], jnp.asarray(value) if "shard" in e else value)
        return _listify(root)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    keys = [json.dumps([_key_entry(k) for k in path]) for path, _ in flat]
    missing = [jax.tree_util.keystr(p) for k, (p, _) in zip(keys, flat) if k not in by_path]
    extra = [_keystr(e["path"]) for k, e in by_path.items() if k not in set(keys)]
    if missing or extra:
        raise InvalidArgumentError(f"target: does not match {ck.job} step {ck.step}: "
                                   f"missing in the checkpoint: {', '.join(missing[:8]) or '-'}; "
                                   f"not in the target: {', '.join(extra[:8]) or '-'}")
    leaves = []
    for key, (path, like) in zip(keys, flat):
        e = by_path[key]
        leaves.append(_place(_array(ck, e), like, jax.tree_util.keystr(path), strict) if "shard" in e else e["value"])
    return jax.tree_util.tree_unflatten(treedef, leaves)


def save_pytree(client: Client, job: str, step: int, tree: Any, *, rank: int = 0, world_size: int = 1,
                metadata: Mapping[str, Any] | None = None, persist: bool = False) -> SaveFuture:
    """Save ``tree`` as ``step`` of ``rank``; returns once the bytes are staged (see :meth:`Client.save`)."""
    shards, _ = encode(tree)
    meta = {"tierckpt.format": FORMAT, "user": dict(metadata or {})}
    return client.save(job, step, rank, world_size, shards, metadata=meta, persist=persist)


def restore_pytree(client: Client, job: str, *, step: int | None = None, rank: int = 0,
                   target: Any = None) -> Any:
    """Restore a pytree saved by :func:`save_pytree` (``step`` default: the latest).

    Raises:
        NotFoundError: no tier holds the step (or the job has none).
    """
    return decode(client.restore(job, rank, step), target)
