"""Packing of small shards (tierckpt._pack): transparent to save/restore, one pack + index on disk."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import tierckpt
from tierckpt import _pack
from tierckpt._buffers import as_buffer

from ..harness import wait_until

_DTYPES = [np.float32, np.float64, np.int8, np.int16, np.int64, np.uint8, np.bool_, np.complex128, np.float16]


def _state(n_small: int = 300, n_large: int = 3, seed: int = 0) -> dict:
    """Small shards of mixed dtypes and shapes (odd sizes, so offsets need padding), interleaved
    with a few large ones, raw bytes and empty arrays."""
    rng = np.random.default_rng(seed)
    state: dict = {}
    for i in range(n_small):
        dt = np.dtype(_DTYPES[i % len(_DTYPES)])
        shape = [(), (int(rng.integers(1, 50)),), (int(rng.integers(1, 9)), int(rng.integers(1, 9))), (0, 3)][i % 4]
        state[f"small.{i:03d}"] = np.asarray(rng.standard_normal(shape) * 100).astype(dt)
        if i % 100 == 50:
            state[f"large.{i}"] = rng.standard_normal((2 << 20) // 4 + 7).astype(np.float32)  # > 2 MiB
        if i % 97 == 0:
            state[f"raw.{i}"] = rng.bytes(int(rng.integers(1, 300)))
    for j in range(n_large):
        state[f"big.{j}"] = rng.integers(0, 255, 2 << 20, dtype=np.uint8)
    return state


def _rank_dir(daemon, job: str, step: int = 1) -> Path:
    return daemon.local_dir / "jobs" / job / f"{step:020d}" / "rank-0000000"


def _stored(daemon, job: str, step: int = 1) -> list[dict]:
    return json.loads((_rank_dir(daemon, job, step) / "manifest.json").read_text())["shards"]


def _assert_same(ck: tierckpt.Checkpoint, state: dict) -> None:
    assert list(ck.shards) == list(state)
    for name, v in state.items():
        got = ck.shards[name]
        if isinstance(v, bytes):
            assert bytes(got) == v and ck.dtypes[name] == "" and ck.shapes[name] == ()
        else:
            assert got.dtype == v.dtype and got.shape == v.shape, name
            assert got.tobytes() == v.tobytes(), name
            assert got.ctypes.data % max(1, v.dtype.alignment) == 0, name  # aligned views
            assert not got.flags.writeable


@pytest.mark.parametrize("transfer", ["shared", "stream"])
def test_round_trip_packs_small_shards(daemon, transfer):
    state = _state()
    small = [n for n, v in state.items() if as_buffer(n, v).nbytes < (2 << 20)]
    addr = daemon.address if transfer == "shared" else daemon.tcp_address
    with tierckpt.Client(addr, transfer=transfer) as c:
        c.save("job", 1, 0, 1, state).result(60)
        names = {s["name"] for s in _stored(daemon, "job")}
        assert names == ({_pack.PACK, _pack.INDEX} | set(state)) - set(small)
        # the two transfer modes lay out the same pack, and the client still sees every shard
        for reader in ("shared", "stream"):
            with tierckpt.Client(daemon.address if reader == "shared" else daemon.tcp_address,
                                 transfer=reader) as r:
                with r.restore("job", 0) as ck:
                    _assert_same(ck, state)
                    assert _pack.PACK not in ck.shards and _pack.INDEX not in ck.shards
                    assert ck.tensor("small.000").shape == state["small.000"].shape
        assert c.list("job")[0].ranks[0].nbytes == sum(s["size"] for s in _stored(daemon, "job"))


def test_second_save_reuses_the_pack_and_checkpoint_close_releases(daemon):
    """Saves of the same layout recycle the pack file (kept map) and produce identical results;
    closing a restored checkpoint unmaps the pack."""
    with daemon.client() as c:
        for step in (1, 2, 3):
            state = _state(n_small=40, n_large=0, seed=step)
            c.save("job", step, 0, 1, state).result(60)
            ck = c.restore("job", 0, step=step)
            _assert_same(ck, state)
            kept = ck.shards["small.001"]
            ck.close()
            assert ck.shards == {}
            assert kept.tobytes() == state["small.001"].tobytes()  # a held array keeps its map
            del kept


def test_corrupt_packed_shard_is_data_loss(daemon):
    state = _state(n_small=40, n_large=0)
    with daemon.client() as c:
        c.save("job", 1, 0, 1, state).result(60)
    index = json.loads(next(_rank_dir(daemon, "job").glob(f"{_pack.INDEX}.*")).read_bytes())
    entry = next(e for e in index["shards"] if e["name"] == "small.006")
    pack = next(_rank_dir(daemon, "job").glob(f"{_pack.PACK}.*"))
    with open(pack, "r+b") as fh:
        fh.seek(entry["offset"] + entry["size"] // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    with tierckpt.Client(daemon.address, verify=False) as c:  # not verifying: served as stored
        with c.restore("job", 0) as ck:
            assert ck.shards["small.006"].tobytes() != state["small.006"].tobytes()
    with daemon.client() as c:
        with pytest.raises(tierckpt.DataLossError):
            c.restore("job", 0)


def test_reserved_name_is_refused(daemon):
    with daemon.client() as c:
        with pytest.raises(tierckpt.InvalidArgumentError, match="shards"):
            c.save("job", 1, 0, 1, {"__tierckpt_pack__": b"x"})
        with pytest.raises(tierckpt.InvalidArgumentError, match="reserved"):
            c.save("job", 1, 0, 1, {"a": b"x", "__tierckpt_mine": b"y"})
        assert c.list("job") == []


def test_a_name_too_long_to_store_is_refused_packed_or_not(daemon):
    """Packing must not change which names a save accepts (the daemon stores at most 231 bytes)."""
    long = "n" * 240
    with daemon.client() as c:
        for small in (1, 40):  # not packed, packed
            shards = {f"s{i}": b"x" for i in range(small)} | {long: b"y"}
            with pytest.raises(tierckpt.InvalidArgumentError, match="shards.*231 bytes"):
                c.save("job", 1, 0, 1, shards)
        assert c.list("job") == []


def test_pack_disabled_or_too_few_small_shards_keeps_one_file_per_shard(daemon):
    state = _state(n_small=40, n_large=1)
    with tierckpt.Client(daemon.address, pack_below=0) as c:
        c.save("off", 1, 0, 1, state).result(60)
        assert [s["name"] for s in _stored(daemon, "off")] == list(state)
        _assert_same(c.restore("off", 0), state)
    few = {f"s{i}": np.full(10, i, np.int32) for i in range(15)} | {"big": np.zeros(2 << 20, np.uint8)}
    with daemon.client() as c:  # defaults: 16 small shards at least
        c.save("few", 1, 0, 1, few).result(60)
        assert [s["name"] for s in _stored(daemon, "few")] == list(few)
        # 1 MiB tensors are packed by default (their fixed per-file cost dominates their copy).
        c.save("more", 1, 0, 1, few | {"s15": np.ones(3, np.int32), "mid": np.ones(1 << 20, np.uint8)}).result(60)
        assert sorted(s["name"] for s in _stored(daemon, "more")) == sorted(["big", _pack.PACK, _pack.INDEX])
    with pytest.raises(tierckpt.InvalidArgumentError, match="pack_below"):
        tierckpt.Client(daemon.address, pack_below=-1)


# ------------------------------------------------------------------ the index read back

def _index(n: int = 20) -> tuple[_pack.Layout, dict]:
    bufs = [as_buffer(f"s{i}", np.arange(i + 1, dtype=np.int16)) for i in range(n)]
    layout = _pack.plan(bufs, 1 << 20, 16)
    assert layout is not None
    return layout, json.loads(_pack.encode_index(layout, ["0123456789abcdef"] * n))


def test_layout_is_aligned_and_the_index_has_its_reserved_size():
    layout, doc = _index()
    assert all(e.offset % _pack.ALIGN == 0 for e in layout.entries)
    assert len(_pack.encode_index(layout, ["f" * 16] * len(layout.entries))) == layout.index_size
    got = _pack.decode_index(json.dumps(doc).encode(), layout.size, [], "w")
    assert [(e.name, e.offset, e.size, e.shape) for e in got] == \
        [(e.name, e.offset, e.size, e.shape) for e in layout.entries]


@pytest.mark.parametrize("corrupt", [
    lambda d: d["shards"][3].update(offset=d["shards"][2]["offset"]),  # overlap
    lambda d: d["shards"][3].update(offset=d["shards"][3]["offset"] + 2),  # misaligned
    lambda d: d["shards"][-1].update(size=10 ** 9),  # beyond the pack
    lambda d: d["shards"][1].update(name="../etc"),  # invalid name
    lambda d: d["shards"][1].update(name="s0"),  # repeated name
    lambda d: d["shards"][1].update(name=_pack.PACK),  # reserved name
    lambda d: d["shards"][1].update(position=0),  # repeated position
    lambda d: d["shards"][1].update(shape=[99]),  # shape does not fit the size
    lambda d: d["shards"][1].update(dtype="O"),  # object dtype
    lambda d: d["shards"][1].update(checksum="xyz"),
    lambda d: d.update(count=3),
    lambda d: d.update(pack_size=1),
    lambda d: d.update(format="other"),
])
def test_corrupt_index_is_data_loss(corrupt):
    layout, doc = _index()
    corrupt(doc)
    with pytest.raises(tierckpt.DataLossError, match="pack index"):
        _pack.decode_index(json.dumps(doc).encode(), layout.size, [], "job step 1 rank 0")
    with pytest.raises(tierckpt.DataLossError):
        _pack.decode_index(b"\xff{not json", layout.size, [], "w")


def test_restored_pack_is_lent_until_its_last_view_is_gone(daemon_factory):
    """The pack's map is a loan like any restored file: Checkpoint.close() ends it, unless an
    array of a packed shard is still held; then it ends once that array is collected."""
    from .test_readers import _begin_recycled

    d = daemon_factory(args=("--keep-local", "1"))
    state = {f"s{i}": np.full(1000 + i, i, np.int32) for i in range(20)}
    with tierckpt.Client(d.address) as c:
        c.save("j", 1, 0, 1, state).result(60)
        size = next(s["size"] for s in _stored(d, "j") if s["name"] == _pack.PACK)
        with c.restore("j", 0, step=1) as ck:
            assert int(ck.shards["s3"][0]) == 3
        c.save("j", 2, 0, 1, state).result(60)  # evicts step 1 into the pool
        assert _begin_recycled(d, 3, size)
        ck = c.restore("j", 0, step=2)
        arr = ck.shards["s5"]
        ck.close()  # arr still maps the pack: no release yet
        c.save("j", 3, 0, 1, state).result(60)  # evicts step 2: held
        assert not _begin_recycled(d, 4, size)
        assert int(arr[0]) == 5
        del arr, ck
        gc.collect()
        wait_until(lambda: _begin_recycled(d, 5, size), 60, "the release to reach the daemon", 0.05)
