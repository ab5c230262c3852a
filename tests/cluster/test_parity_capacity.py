"""Parity counts against ``local_capacity`` (issue 32 item 4, retention), real daemons on
loopback with ``parity:2+1``: a protector whose local tier is nearly full makes room for a parity
chunk by evicting an old step that is safe elsewhere (as a save would), instead of refusing the
chunk, and the parity it holds is part of its charged bytes (``status().used_bytes``)."""

from __future__ import annotations

import os

import numpy as np
from tierckpt.common import checksum
from tierckptd.local.store import LocalStore
from tierckptd.parity.slots import Slot, growth_of

from ..harness import free_port, wait_until

S_OLD = 150_000
S_BIG = 300_000
CAPACITY = 400_000


def _arr(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def _parity_bytes(d) -> int:
    return sum(p.stat().st_size for p in (d.local_dir / "parity").rglob("slot-*.bin"))


def _full_protector(daemon_factory) -> dict:
    """parity:2+1 on n0-n2; n1 (local_capacity CAPACITY) holds two steps of its own job "old",
    then protects a chunk of n0's and n2's ranks of "big" (one slot, S_BIG / 2 bytes), which
    does not fit beside them without an eviction."""
    ids = ["n0", "n1", "n2"]
    ports = {n: free_port() for n in ids}
    common = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "0",
              "--redundancy", "parity:2+1", "--keep-local", "5", "--knobs", "refresh_interval=0.2")
    d = {n: daemon_factory(n, port=ports[n], args=(*common, *(("--local-capacity", str(CAPACITY)) if n == "n1"
                                                               else ()))) for n in ids}
    with d["n1"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} == {"n0", "n2"}, 30, "n1 sees its group")
        for step in (1, 2):  # two steps of another job, protected by n0 and n2: step 1 is safe elsewhere
            c.save("old", step, 0, 1, {"w": _arr(step, S_OLD)}).wait("peer", timeout=60)
        before = c.status().used_bytes
        assert before + S_BIG // 2 > CAPACITY  # a parity chunk of "big" does not fit without an eviction
    for n, rank in (("n0", 0), ("n2", 2)):
        with d[n].client() as c:
            assert "n1" in c.save("big", 1, rank, 3, {"w": _arr(10 + rank, S_BIG)}).wait("peer", timeout=60)
    return d


def test_a_full_protector_evicts_an_old_safe_step_to_make_room_for_parity(daemon_factory):
    d = _full_protector(daemon_factory)
    with d["n1"].client() as c:
        steps = {i.step for i in c.list("old") if any("n1" in r.nodes for r in i.ranks)}
        assert 1 not in steps and 2 in steps  # the oldest safe step made room; the newest stays
        parity = _parity_bytes(d["n1"])
        assert parity >= S_BIG // 2
        st = c.status()
        assert parity <= st.used_bytes <= CAPACITY  # charged, within the capacity
    assert "no room here" not in d["n0"].log_text() + d["n2"].log_text()


def test_a_protector_without_room_does_not_decode_for_a_restore_the_restorer_does(daemon_factory):
    """n0 is replaced (kill -9, wiped): its rank's chunk 0 is decoded from n1's slot. n1 has less
    free room than that chunk, so it refuses to decode it for n0 (nothing is evicted for a
    restoring node's transient file, and the local tier never goes past local_capacity); n0
    decodes the chunk itself from n1's slot and n2's chunk, and restores the exact bytes."""
    d = _full_protector(daemon_factory)
    with d["n1"].client() as c:
        st = c.status()
        assert st.capacity_bytes - st.used_bytes < S_BIG // 2
    d["n0"].kill()
    d["n0"].wipe()
    d["n0"].start()
    with d["n0"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} == {"n1", "n2"}, 30, "n0 sees its group")
        ck = c.restore("big", 0, step=1)
        assert checksum.digest(np.asarray(ck.shards["w"])) == checksum.digest(_arr(10, S_BIG))
    assert "decoded for a restoring node" in d["n1"].log_text() + d["n0"].log_text()
    assert "could not decode it for us over bulk" in d["n0"].log_text()
    with d["n1"].client() as c:
        assert c.status().used_bytes <= CAPACITY


def test_a_delta_update_of_a_shared_slot_makes_room_for_its_private_copy(daemon_factory):
    """parity:4+1: n1 protects one slot (a quarter of each other node's rank) per step. Step 2
    changes one of its four members, so n1's slot of step 2 is a private copy of step 1's updated
    by that member's delta (:mod:`tierckptd.parity.share`): a whole new file, charged in full. n1
    is nearly full, so room is made first (its oldest safe step evicted), as for a chunk encoded
    anew; the copy never takes the local tier past local_capacity."""
    ids = [f"n{i}" for i in range(5)]
    ports = {n: free_port() for n in ids}
    common = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "0",
              "--redundancy", "parity:4+1", "--keep-local", "5", "--knobs", "refresh_interval=0.2")
    capacity, s_old, s_big = 290_000, 100_000, 200_000
    d = {n: daemon_factory(n, port=ports[n], args=(*common, *(("--local-capacity", str(capacity)) if n == "n1"
                                                               else ()))) for n in ids}
    others = [n for n in ids if n != "n1"]
    with d["n1"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} == set(others), 30, "n1 sees its group")
        for step in (1, 2):
            c.save("old", step, 0, 1, {"w": _arr(step, s_old)}).wait("peer", timeout=60)

    def save_big(step: int, changed: str) -> None:  # all at once: the members of a slot are shared together
        clients = {n: d[n].client() for n in others}
        try:
            futs = [c.save("big", step, rank, len(others),
                           {"w": _arr(100 * step + rank if n == changed else 100 + rank, s_big)},
                           unchanged=() if n == changed or step == 1 else ["w"])
                    for rank, (n, c) in enumerate(clients.items())]
            for fut in futs:
                fut.wait("peer", timeout=60)
        finally:
            for c in clients.values():
                c.close()

    save_big(1, "")
    slot1 = list((d["n1"].local_dir / "parity" / "big" / f"{1:020d}").glob("slot-*.bin"))
    assert len(slot1) == 1 and slot1[0].stat().st_size == s_big // 4
    with d["n1"].client() as c:
        before = c.status().used_bytes
        assert before + s_big // 4 > capacity  # the copy does not fit without an eviction
        assert {i.step for i in c.list("old")} == {1, 2}
    save_big(2, "n0")
    slot2 = list((d["n1"].local_dir / "parity" / "big" / f"{2:020d}").glob("slot-*.bin"))
    assert len(slot2) == 1 and slot2[0].stat().st_ino != slot1[0].stat().st_ino  # updated by delta: a copy
    with d["n1"].client() as c:
        held = {i.step for i in c.list("old") if any("n1" in r.nodes for r in i.ranks)}
        assert held == {2}  # the oldest safe step made room for the copy
        assert c.status().used_bytes <= capacity
    assert "no room here" not in "".join(d[n].log_text() for n in others)


def test_growth_of_a_linked_slot_is_its_whole_copy():
    """Adding a chunk to a slot whose file is linked into another step copies the file first
    (:func:`tierckptd.parity.share.unshare`): the charge grows by the whole copy, not by the
    chunk's excess over the slot."""
    linked, alone = Slot(0, 1000, ino=(1, 7)), Slot(1, 1000, ino=(1, 8))
    steps = {("j", 1): {0: Slot(0, 1000, ino=(1, 7))}, ("j", 2): {0: linked, 1: alone}}
    assert growth_of(linked, 400, steps) == 1000
    assert growth_of(linked, 1500, steps) == 1500
    assert growth_of(alone, 400, steps) == 0
    assert growth_of(alone, 1500, steps) == 500
    assert growth_of(None, 400, steps) == 400


def test_external_charge_counts_and_make_room_evicts(tmp_path):
    store = LocalStore(tmp_path / "l", "n0", capacity=64 << 10, keep_local=5)
    store.open()
    try:
        held = [0]
        store.external_charge = lambda: held[0]
        for step in (1, 2):
            st = store.begin("j", step, 0, 1, [("w", 20_000, "|u1", (20_000,))])
            fd = store.open_staged(st.save_id, "w")
            os.pwrite(fd, b"x" * 20_000, 0)
            os.close(fd)
            store.commit(st.save_id, {"w": checksum.digest(np.frombuffer(b"x" * 20_000, np.uint8))})
        base = store.usage().charged
        held[0] = 5_000
        assert store.usage().charged == base + 5_000
        store.make_room(30_000, "j")  # does not fit beside two steps: the older one goes
        assert set(store.steps("j")) == {2}
        held[0] += 30_000
        assert store.usage().charged <= store.capacity
    finally:
        store.close()
