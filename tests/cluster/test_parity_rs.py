"""Reed-Solomon parity (``--redundancy parity:4+2``) with real daemons on loopback: a 6-node group
survives the loss of any two nodes with 1 + 2/4 of the memory; three lost nodes fall back to the
persistent tier (or a DataLossError / UnavailableError without one); a corrupt parity row is
detected and never yields wrong bytes."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import grpc
import numpy as np
import pytest
import tierckpt
from tierckpt.common import checksum as _checksum
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc
from tierckptd.config import ConfigError, parse_args
from tierckptd.parity import rslayout

from ..harness import Cluster, wait_until

RS = ("--redundancy", "parity:4+2")


def shard(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


# ------------------------------------------------------------------------------ rules (pure)

def test_config_accepts_k_plus_m_up_to_32_naming_the_field():
    cfg = parse_args(["--redundancy", "parity:4+2", "--replicas", "2"])
    assert cfg.parity == (4, 2) and cfg.replicas == 0
    assert parse_args(["--redundancy", "parity:29+3"]).parity == (29, 3)
    for bad, why in (("parity:30+3", "K \\+ M <= 32"), ("parity:4+0", "M >= 1"), ("parity:0+2", "K >= 1")):
        with pytest.raises(ConfigError, match=f"^redundancy: .*{why}"):
            parse_args(["--redundancy", bad])


def test_rs_layout_every_stripe_on_distinct_nodes_parity_rotates():
    g = [f"n{i}" for i in range(6)]
    stripes: dict[int, set[str]] = {}
    rows_per_node = dict.fromkeys(g, 0)
    for owner in g:
        t = rslayout.targets(owner, g, 2)
        assert len(t) == 4 * 2 and all(h != owner for h, _, _ in t)
        for c in range(4):
            s = rslayout.stripe_of(owner, g, 2, c)
            stripes.setdefault(s, set()).add(owner)
        for h, _, _ in t:
            rows_per_node[h] += 1
    for s, data in stripes.items():
        assert len(data) == 4 and not data & set(rslayout.row_holders(s, g, 2))
    assert set(rows_per_node.values()) == {8}  # 2 stripes x 4 members each: M/K of the data per node
    # a remainder of fewer than M + 1 nodes joins the group before
    assert [len(x) for x in rslayout.layout.groups([f"n{i:02d}" for i in range(14)], 6, 3)] == [6, 8]
    rslayout.check_lane("", 0)
    for lane, row in (("", 1), ("../x-1", 1), ("a" * 40 + "-1", 1)):
        with pytest.raises(tierckpt.InvalidArgumentError, match="^lane: "):
            rslayout.check_lane(lane, row)


# ------------------------------------------------------------------------------ real daemons

def _save_all(cl: Cluster, job: str, step: int, sizes: list[int], per_node: int = 1,
              also: str = "") -> dict[int, dict[str, str]]:
    """Rank r saved on node n{r % 6}; wait('peer') on each. Returns the checksums."""
    world = len(cl.ids) * per_node
    sums: dict[int, dict[str, str]] = {}
    clients, futs = [], []
    try:
        for rank in range(world):
            node = cl.ids[rank % len(cl.ids)]
            c = cl.d[node].client()
            clients.append(c)
            a, b = shard(step * 100 + rank, sizes[rank]), shard(step * 100 + rank + 50, 333 + rank)
            sums[rank] = {"a": _checksum.digest(a), "b": _checksum.digest(b)}
            futs.append((node, c.save(job, step, rank, world, {"a": a, "b": b}, metadata={"rank": rank})))
        for node, fut in futs:
            holders = fut.wait("peer", timeout=120)
            assert node not in holders and 2 <= len(holders) <= 5
            if also:
                fut.wait(also, timeout=120)
    finally:
        for c in clients:
            c.close()
    return sums


def _rows(d) -> list[Path]:
    return sorted((d.local_dir / "parity-rs").rglob("row-*.json"))


def _row_bytes(d) -> int:
    return sum(p.stat().st_size for p in (d.local_dir / "parity-rs").rglob("row-*.bin"))


def _restored(c, job: str, rank: int, step: int, sums) -> str:
    ck = c.restore(job, rank, step=step)
    assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[rank], rank
    assert ck.metadata == {"rank": rank}
    return ck.tier


def test_two_nodes_lost_every_rank_restored_exactly(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS)
    job = "rs"
    sizes = [300_000 + 7_919 * r for r in range(12)]
    sums = _save_all(cl, job, 5, sizes, per_node=2)  # two ranks per node: two lanes per stripe
    own = {n: sum(sizes[r] + 333 + r for r in range(12) if r % 6 == int(n[1:])) for n in cl.ids}
    for n in cl.ids:  # memory: parity ~ 2/4 of a node's data (rows padded to their longest member)
        assert 0 < _row_bytes(cl.d[n]) <= max(own.values()) * 0.5 + 64, n
    lanes = {json.loads(p.read_text())["lane"] for p in _rows(cl.d["n0"])}
    assert len(lanes) >= 2
    for victim in ("n1", "n4"):
        cl.replace(victim)  # kill -9 and wipe
    for victim in ("n1", "n4"):
        cl.wait_peers(victim)
    with cl.d["n1"].client() as c:
        assert c.latest(job) == 5
        for rank in (1, 7, 4, 10):  # the lost nodes' ranks: reconstructed
            assert _restored(c, job, rank, 5, sums) == "peer"
    with cl.d["n4"].client() as c:
        for rank in range(12):
            assert _restored(c, job, rank, 5, sums) in ("local", "peer")
    assert "reconstructed rs step 5 rank 1 from parity" in cl.d["n1"].log_text()


def test_any_two_of_six_lost_restores_on_a_survivor(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS)
    job = "rsa"
    sums = _save_all(cl, job, 2, [50_000 + 1_001 * r for r in range(6)])
    pairs = [("n2", "n3"), ("n0", "n5")]
    assert all(p in combinations(cl.ids, 2) for p in pairs)
    for a, b in pairs:
        cl.d[a].kill()
        cl.d[b].kill()
        survivor = next(n for n in cl.ids if n not in (a, b))
        with cl.d[survivor].client() as c:
            for rank in (int(a[1:]), int(b[1:])):
                assert _restored(c, job, rank, 2, sums) == "peer"
        cl.start(a)
        cl.start(b)
        for n in cl.ids:  # every node sees the restarted ones up again before the next round
            cl.wait_peers(n)


def test_three_lost_falls_back_to_the_persistent_tier(daemon_factory, scratch: Path):
    bucket = scratch / "bucket"
    cl = Cluster(daemon_factory, 6, replicas=0, extra=(*RS, "--persistent", f"file://{bucket}",
                                                        "--persist-every", "1"))
    job = "rs3"
    sums = _save_all(cl, job, 3, [120_000] * 6, also="persistent")
    cl.d["n2"].kill()
    cl.d["n3"].kill()
    cl.replace("n1")
    with cl.d["n1"].client() as c:
        assert _restored(c, job, 1, 3, sums) == "persistent"


def test_three_lost_without_a_persistent_tier_is_a_clear_error(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS)
    job = "rs3n"
    _save_all(cl, job, 3, [60_000] * 6)
    cl.d["n2"].kill()
    cl.d["n3"].kill()
    cl.replace("n1")
    with cl.d["n1"].client() as c:
        with pytest.raises((tierckpt.NotFoundError, tierckpt.UnavailableError, tierckpt.DataLossError)):
            c.restore(job, 1, step=3)
    assert not list((cl.d["n1"].local_dir / "jobs").rglob("rank-0000001"))  # nothing committed


def _corrupt_a_row_of(cl: Cluster, owner: str) -> str:
    """Flip a byte of one parity row holding a chunk of ``owner``; returns its holder."""
    for n in cl.ids:
        for meta in _rows(cl.d[n]):
            doc = json.loads(meta.read_text())
            if any(m["node"] == owner for m in doc["members"]):
                data = meta.with_suffix(".bin")
                buf = bytearray(data.read_bytes())
                buf[len(buf) // 3] ^= 0x5A
                data.write_bytes(bytes(buf))
                return n
    raise AssertionError(f"no row holds a chunk of {owner}")


def test_a_corrupt_row_is_detected_and_the_restore_falls_back(daemon_factory, scratch: Path):
    bucket = scratch / "bucket"
    cl = Cluster(daemon_factory, 6, replicas=0, extra=(*RS, "--persistent", f"file://{bucket}",
                                                        "--persist-every", "1"))
    job = "rsc"
    sums = _save_all(cl, job, 4, [90_000] * 6, also="persistent")
    holder = _corrupt_a_row_of(cl, "n0")
    others = [n for n in cl.ids if n not in ("n0", holder)]
    cl.d[others[0]].kill()  # two lost (n0 and another): no spare row left for the corrupt one
    cl.replace("n0")
    with cl.d["n0"].client() as c:
        assert _restored(c, job, 0, 4, sums) == "persistent"
    assert "fails its checksum" in cl.d[holder].log_text()


def test_a_corrupt_row_with_a_spare_row_is_still_restored_and_never_wrong(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS)
    job = "rss"
    sums = _save_all(cl, job, 6, [70_000] * 6)
    holder = _corrupt_a_row_of(cl, "n0")
    cl.replace("n0")  # one lost: the corrupt row is refused, the other row of its lane decodes
    cl.wait_peers("n0")
    with cl.d["n0"].client() as c:
        assert _restored(c, job, 0, 6, sums) == "peer"
    assert "fails its checksum" in cl.d[holder].log_text()


def test_hostile_rs_fields_are_refused_naming_the_field(daemon_factory):
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS)
    with grpc.insecure_channel(f"127.0.0.1:{cl.ports['n0']}") as ch:
        stub = ppb_grpc.PeerStub(ch)
        for req, field in ((ppb.ReadParityRowRequest(requester="n1", job="j", step=1, stripe=0, lane="x/y", row=1),
                            "lane"),
                           (ppb.ReadParityRowRequest(requester="n1", job="j", step=1, stripe=0, lane="ab-1", row=7),
                            "row"),
                           (ppb.ReadParityRowRequest(requester="n1", job="j", step=1, stripe=999, lane="ab-1", row=1),
                            "stripe")):
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.ReadParityRow(req, timeout=10))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, ei.value.details())
            assert ei.value.details().startswith(f"{field}: "), ei.value.details()
        for row, lane, field in ((9, "", "row"), (1, "", "lane"), (1, "zz-1", "lane")):
            with pytest.raises(grpc.RpcError) as ei:
                stub.ProtectRank(ppb.ProtectRankRequest(sender="n1", manifest_json="{}", chunk=0, chunks=4, row=row,
                                                        lane=lane), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, ei.value.details())
            assert ei.value.details().startswith(f"{field}: "), ei.value.details()


def test_nodes_with_and_without_isal_decode_each_others_rows(daemon_factory):
    """Half the group on the numpy fallback (TIERCKPT_NO_ISAL=1): rows written by one backend
    decode with the other, byte-exact."""
    def factory(node, *, port, args):
        return daemon_factory(node, port=port, args=args, env={"TIERCKPT_NO_ISAL": "1"} if node in ("n0", "n2", "n4")
                              else None)

    cl = Cluster(factory, 6, replicas=0, extra=RS)
    assert "Reed-Solomon on numpy" in cl.d["n0"].log_text()
    job = "rsmix"
    sums = _save_all(cl, job, 1, [80_000 + 3 * r for r in range(6)])
    cl.replace("n3")
    cl.replace("n4")
    cl.wait_peers("n3")
    with cl.d["n3"].client() as c:  # on ISA-L
        assert _restored(c, job, 3, 1, sums) == "peer"
    cl.wait_peers("n4")
    with cl.d["n4"].client() as c:  # on numpy
        assert _restored(c, job, 4, 1, sums) == "peer"


def test_a_replaced_holder_is_sent_its_rows_again_and_they_decode(daemon_factory):
    """n2 is wiped: its rows (row 0 of some lanes) are protected again, in new lanes, on every
    row of those chunks; then two other nodes are lost and their ranks still decode."""
    cl = Cluster(daemon_factory, 6, replicas=0, extra=RS)
    job = "rsr"
    sums = _save_all(cl, job, 8, [64_000 + 5 * r for r in range(6)])
    before = len(_rows(cl.d["n2"]))
    cl.replace("n2")
    cl.wait_peers("n2")
    with cl.d["n2"].client() as c:  # its own rank back first (else a third block of each stripe is lost)
        assert _restored(c, job, 2, 8, sums) == "peer"
    def lanes_complete() -> bool:
        """Every lane with a row on n2 has its other row, with the same members, on its holder."""
        docs = {n: [json.loads(p.read_text()) for p in _rows(cl.d[n])] for n in cl.ids}
        mine = docs["n2"]
        if len(mine) < before:
            return False
        for d in mine:
            other = 1 - d["row"]
            holder = rslayout.row_holders(d["stripe"], cl.ids, 2)[other]
            twin = [x for x in docs[holder] if (x["stripe"], x["lane"], x["row"]) == (d["stripe"], d["lane"], other)]
            if not twin or {m["node"] for m in twin[0]["members"]} != {m["node"] for m in d["members"]}:
                return False
        return True

    wait_until(lanes_complete, timeout=90, what="n2's rows protected again, on both rows of each lane")
    cl.d["n0"].kill()
    cl.d["n5"].kill()
    with cl.d["n2"].client() as c:
        for rank in (0, 5):
            assert _restored(c, job, rank, 8, sums) == "peer"
