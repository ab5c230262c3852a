"""Issue 24 ("restart in any shape"), the parts one process shows: how DCP readers of any world
size agree on a step (pure rules and a fake daemon), pickling the Writer and Reader,
``overwrite=False``, a step re-saved from fewer ranks, and rank-for-rank formats refusing a
changed world size. The multi-process restarts are in tests/dcp/test_elastic.py."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import tierckpt  # noqa: E402
import tierckpt.dcp as tdcp  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from tierckpt.agree import agreed_step  # noqa: E402
from tierckpt.client import StepAvailability  # noqa: E402
from tierckpt.manager import CheckpointManager  # noqa: E402
from tierckpt.torch import Checkpointer  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ------------------------------------------------------------------------- a daemon that is a dict


@dataclass
class _Ck:
    step: int
    rank: int
    world_size: int
    shards: dict
    metadata: dict = field(default_factory=dict)
    tier: str = "local"

    def close(self) -> None:
        pass


class FakeDaemon:
    """``held[(step, world)] = ranks`` restorable; ``lost`` ranks answer availability but fail
    to restore (a copy gone between the two calls)."""

    def __init__(self, held: dict[tuple[int, int], set[int]], lost: set[tuple[int, int]] = frozenset()) -> None:
        self.held, self.lost, self.calls = held, lost, []

    def save(self, *a, **k):
        raise NotImplementedError

    def availability(self, job: str, rank: int) -> list[StepAvailability]:
        self.calls.append(rank)
        return [StepAvailability(s, w, ("local",)) for (s, w), ranks in sorted(self.held.items()) if rank in ranks]

    def restore(self, job: str, rank: int, step: int) -> _Ck:
        world = next((w for (s, w), ranks in self.held.items() if s == step and rank in ranks), None)
        if world is None or (step, rank) in self.lost:
            raise tierckpt.NotFoundError(f"{job} step {step} rank {rank} is not held by any tier")
        meta = dcp.metadata.Metadata(state_dict_metadata={}, storage_data={})
        return _Ck(step, rank, world, {tdcp.METADATA_SHARD: np.frombuffer(pickle.dumps(meta), np.uint8)},
                   {"dcp_save_id": f"s{step}"})


# A 4-rank DCP save is tierckpt world 5 (rank 4: the metadata). Step 1 complete; step 2's
# metadata commit failed; step 3 lost the node holding ranks 2-3 (and so its metadata).
DIED = {(1, 5): {0, 1, 2, 3, 4}, (2, 5): {0, 1, 2, 3}, (3, 5): {0, 1}}


@pytest.mark.parametrize("readers", [1, 2, 3, 4, 8])
def test_readers_of_any_world_size_agree_only_on_a_loadable_step(readers):
    union: dict[tuple[int, int], set[int]] = {}
    calls = 0
    for me in range(readers):
        d = FakeDaemon(DIED)
        for key, ranks in tdcp.held_ranks(d, "j", me, readers).items():
            union.setdefault(key, set()).update(ranks)
        calls += len(d.calls)
        assert all(r % readers == me for r in d.calls)
    assert tdcp.loadable(union) == [(1, 5)]
    assert calls <= 5 + readers  # each saved rank asked about once (plus one empty answer per reader)
    # An explicit step is checked the same way.
    assert tdcp.loadable(tdcp.held_ranks(FakeDaemon(DIED), "j", 0, 1, step=3)) == []


def test_held_ranks_stops_at_a_rank_no_step_holds():
    d = FakeDaemon({(7, 9): {0, 1, 3, 4, 5, 6, 7, 8}})  # rank 2 lost: no step needing it can load
    assert tdcp.held_ranks(d, "j", 0, 1) == {(7, 9): [0, 1]}
    assert d.calls == [0, 1, 2]


def test_a_step_resaved_with_another_world_size_is_one_save_or_the_other():
    union = {(5, 5): {3, 4}, (5, 3): {0, 1, 2}}  # re-saved from 2 ranks; the earlier save's ranks 3-4 remain
    assert tdcp.loadable(union) == [(5, 3)]


def test_reader_falls_back_when_the_agreed_metadata_cannot_be_restored():
    d = FakeDaemon({(1, 3): {0, 1, 2}, (2, 3): {0, 1, 2}}, lost={(2, 2)})
    r = tdcp.Reader("j", client=d)  # type: ignore[arg-type]
    r.read_metadata()
    assert (r.step, r.world_size, r._save_id) == (1, 3, "s1")
    with pytest.raises(tierckpt.NotFoundError, match="step 2: the DCP metadata cannot be restored"):
        tdcp.Reader("j", 2, client=d).read_metadata()  # type: ignore[arg-type]
    with pytest.raises(tierckpt.NotFoundError, match=r"step 3 is incomplete: ranks \[2, 3\] of 4 DCP ranks and "
                                                     r"the DCP metadata \(rank 4\)"):
        tdcp.Reader("j", 3, client=FakeDaemon(DIED)).read_metadata()  # type: ignore[arg-type]


def test_reader_and_writer_refuse_bad_input_naming_the_field():
    with pytest.raises(tierckpt.InvalidArgumentError, match="^job"):
        tdcp.Writer("bad/job", 1, address="unix:///nowhere")
    with pytest.raises(tierckpt.InvalidArgumentError, match="^step"):
        tdcp.Reader("j", -1, address="unix:///nowhere")
    with pytest.raises(tierckpt.InvalidArgumentError, match="^overwrite"):
        tdcp.Writer("j", 1, address="unix:///nowhere", overwrite="no")  # type: ignore[arg-type]
    with pytest.raises(tierckpt.InvalidArgumentError, match="^client"):
        tdcp.Writer("j", 1, client=object())  # type: ignore[arg-type]
    with pytest.raises(tierckpt.InvalidArgumentError, match="^collective"):
        tdcp.Reader("j", address="unix:///nowhere", collective="yes")  # type: ignore[arg-type]
    with pytest.raises(tierckpt.InvalidArgumentError, match="^pack_below"):
        tdcp.Writer("j", 1, address="unix:///nowhere", pack_below=-1)


# ------------------------------------------------------------------------- pickling


def test_writer_and_reader_pickle_and_reconnect_lazily(daemon):
    with daemon.client(timeout=12.5, transfer="stream") as c:
        w = tdcp.Writer("pick", 3, client=c, persist=True, overwrite=False)
        w2 = pickle.loads(pickle.dumps(w))
        assert w2._client is None and (w2.job, w2.step, w2.persist, w2.overwrite) == ("pick", 3, True, False)
        assert w2.address == daemon.address and w2.client is not c
        assert (w2.client.timeout, w2.client.transfer) == (12.5, "stream")  # the client's options travel
        by_address = pickle.loads(pickle.dumps(tdcp.Reader("pick", address=daemon.address, group=object())))
        assert by_address.group is None and by_address.client.address == daemon.address
        # The unpickled writer saves and the unpickled reader loads.
        sd = {"w": torch.arange(10.0)}
        dcp.save(sd, storage_writer=w2)
        target = {"w": torch.zeros(10)}
        dcp.load(target, storage_reader=pickle.loads(pickle.dumps(tdcp.Reader("pick", client=c))))
        assert torch.equal(target["w"], sd["w"])


# ------------------------------------------------------------------------- overwrite, re-save


def test_overwrite_false_refuses_an_existing_step(daemon):
    with daemon.client() as c:
        dcp.save({"x": torch.ones(3)}, storage_writer=tdcp.Writer("ow", 1, client=c, overwrite=False))  # a new step
        with pytest.raises(CheckpointException, match="Checkpoint already exists"):
            dcp.save({"x": torch.zeros(3)}, storage_writer=tdcp.Writer("ow", 1, client=c, overwrite=False))
        target = {"x": torch.zeros(3)}
        dcp.load(target, storage_reader=tdcp.Reader("ow", 1, client=c))
        assert torch.equal(target["x"], torch.ones(3))  # untouched
        dcp.save({"x": torch.full((3,), 2.0)}, storage_writer=tdcp.Writer("ow", 1, client=c))  # default: replace
        dcp.load(target, storage_reader=tdcp.Reader("ow", 1, client=c))
        assert torch.equal(target["x"], torch.full((3,), 2.0))
        # Data ranks without committed metadata (a save that died) are not "a checkpoint".
        c.save("ow", 2, rank=0, world_size=2, shards={"packed": b"x"}).result()
        dcp.save({"x": torch.ones(3)}, storage_writer=tdcp.Writer("ow", 2, client=c, overwrite=False))


def _earlier_four_rank_save(c, job: str, step: int) -> None:
    """What a 4-rank DCP save leaves: data ranks 0-3 and the metadata rank 4 (world size 5)."""
    for r in range(4):
        c.save(job, step, r, 5, {"packed": bytes([r + 1]) * 64},
               metadata={"tierckpt.dcp": "data", "dcp_world_size": 4, "dcp_save_id": "old"}).result()
    c.save(job, step, 4, 5, {tdcp.METADATA_SHARD: b"not read"},
           metadata={"tierckpt.dcp": "metadata", "dcp_world_size": 4, "dcp_save_id": "old"}).result()


def test_a_step_resaved_from_fewer_ranks_loads_only_what_the_resave_wrote(daemon):
    with daemon.client() as c:
        _earlier_four_rank_save(c, "fewer", 7)
        sd = {"w": torch.randn(64, 64), "n": torch.tensor(3)}
        dcp.save(sd, storage_writer=tdcp.Writer("fewer", 7, client=c))  # one rank now: world size 2
        (info,) = c.list("fewer")
        assert (info.world_size, info.complete, [r.rank for r in info.ranks]) == (2, True, [0, 1])
        assert c.latest("fewer") == 7
        for step in (7, None):
            target = {"w": torch.zeros(64, 64), "n": torch.tensor(0)}
            reader = tdcp.Reader("fewer", step, client=c)
            dcp.load(target, storage_reader=reader)
            assert torch.equal(target["w"], sd["w"]) and target["n"].item() == 3
            assert (reader.step, reader.world_size) == (7, 2)


def test_a_data_rank_of_another_save_is_never_mixed_in(daemon):
    with daemon.client() as c:
        dcp.save({"w": torch.ones(4)}, storage_writer=tdcp.Writer("mixed", 1, client=c))
        # Rank 0 re-written by another save (one that died before its metadata commit).
        c.save("mixed", 1, 0, 2, {"packed": bytes(16)},
               metadata={"tierckpt.dcp": "data", "dcp_world_size": 1, "dcp_save_id": "other"}).result()
        with pytest.raises(CheckpointException, match="DataLossError.*written by DCP save other"):
            dcp.load({"w": torch.zeros(4)}, storage_reader=tdcp.Reader("mixed", 1, client=c))


# ------------------------------------------------------------------------- rank-for-rank formats


def test_agreed_step_refuses_a_changed_world_size():
    assert agreed_step("j", [[(1, 4), (2, 4)], [(1, 4)]], 4) == 1
    assert agreed_step("j", [[(1, 2), (2, 4)], [(1, 2), (2, 4)]], 4) == 2  # an older size is history
    with pytest.raises(tierckpt.FailedPreconditionError, match="step 2 was saved with world size 4; this process "
                                                               "runs with world size 2"):
        agreed_step("j", [[(1, 2), (2, 4)], [(1, 2), (2, 4)]], 2)
    with pytest.raises(tierckpt.FailedPreconditionError, match="world size 4; .* world size 8"):
        agreed_step("j", [[(2, 4)]] * 4 + [[]] * 4, 8)  # ranks 4-7 see nothing: never "no checkpoint"


def test_checkpointer_and_manager_name_both_world_sizes(daemon):
    with daemon.client() as c:
        for r in range(4):
            with Checkpointer("resize", client=c, rank=r, world_size=4) as ck:
                ck.save(1, {"w": torch.full((3,), float(r))}).result()
        with pytest.raises(tierckpt.FailedPreconditionError, match="saved with world size 4; .* world size 2"):
            Checkpointer("resize", client=c, rank=1, world_size=2).load({"w": torch.zeros(3)}, 1)
        with pytest.raises(tierckpt.FailedPreconditionError, match="saved with world size 4; .* world size 8"):
            Checkpointer("resize", client=c, rank=6, world_size=8).read(1)  # rank 6 was never saved
        with Checkpointer("resize", client=c, rank=3, world_size=4) as ck:
            assert ck.load({"w": torch.zeros(3)}, 1).state["w"][0] == 3.0  # the same shape loads
        for r in range(2):
            c.save("raw", 5, r, 2, {"w": np.full(2, r, np.float32)}, metadata={"tierckpt.format": "raw"}).result()
        with CheckpointManager("raw", client=c, rank=0, world_size=1) as mgr, \
                pytest.raises(tierckpt.FailedPreconditionError, match="world size 2; .* world size 1"):
            mgr.restore(step=5)
