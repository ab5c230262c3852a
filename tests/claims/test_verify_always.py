"""README, "Configuration" (the client's ``verify``): ``verify=True`` checks the checksums of
copies served from the local tier; a copy the daemon has just fetched from a peer or the object
store was verified by the daemon as it arrived and is not hashed a second time; ``"always"``
hashes it too. A mismatch is never returned: the client reports the copy, the daemon drops it and
serves the next tier ("a restore drops a corrupt copy and uses another"); with no good copy left
the restore raises ``DataLossError``. Real daemons, a ``file://`` persistent tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb

from ._util import flip_bit, noise, rank_dir

SIZES = {"model": 300_000, "optim": 5_000}


def _shards(step: int) -> dict[str, bytes]:
    return {name: noise(size, step, i) for i, (name, size) in enumerate(SIZES.items())}


def _got(ck) -> dict[str, bytes]:
    return {name: bytes(a) for name, a in ck.shards.items()}


class _DamageAfterFetch:
    """Sits in front of a client's stub: the first Restore answered from a remote tier has one
    bit of its just-fetched local file flipped before the client maps it (damage between the
    daemon's check on arrival and the trainer's read). Records each request's corrupt report."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self.flipped: list[str] = []
        self.reports: list[tuple[bool, str]] = []

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    def Restore(self, req: pb.RestoreRequest, **kw):
        self.reports.append((req.local_corrupt, req.corrupt_generation))
        resp = self._stub.Restore(req, **kw)
        if not self.flipped and resp.tier != pb.TIER_LOCAL:
            s = max(resp.shards, key=lambda s: s.size)
            flip_bit(Path(s.path), s.size // 2)
            self.flipped.append(s.name)
        return resp


def test_always_rehashes_a_copy_fetched_from_the_persistent_tier(daemon_factory, scratch: Path) -> None:
    d = daemon_factory(args=("--persistent", (scratch / "store").as_uri(), "--persist-every", "1"))
    with d.client() as c:
        c.save("job", 1, 0, 1, _shards(1)).wait("persistent", timeout=60)
    for verify in ("always", True):
        d.kill()
        d.wipe()  # no local copy: the restore fetches the rank from the persistent tier
        d.start()
        with d.client(verify=verify) as c:
            hook = _DamageAfterFetch(c._stub)
            c._stub = hook
            ck = c.restore("job", 0, step=1)
            assert hook.flipped == ["model"] and ck.step == 1
            if verify == "always":  # caught: reported, dropped, fetched again, good bytes
                assert _got(ck) == _shards(1) and ck.tier == "persistent"
                assert [r[0] for r in hook.reports] == [False, True] and hook.reports[1][1]
            else:  # the documented difference: the daemon's check on arrival is the only one
                assert _got(ck)["model"] != _shards(1)["model"] and hook.reports == [(False, "")]
            del ck


def test_always_checks_the_local_copy_and_falls_back_to_the_next_tier(daemon_factory, scratch: Path) -> None:
    d = daemon_factory(args=("--persistent", (scratch / "store").as_uri(), "--persist-every", "1"))
    with d.client(verify="always") as c:
        c.save("job", 1, 0, 1, _shards(1)).wait("persistent", timeout=60)
        local = next(rank_dir(d.local_dir, "job", 1, 0).glob("model.*"))
        flip_bit(local, 1234)
        ck = c.restore("job", 0, step=1)
        assert ck.tier == "persistent" and _got(ck) == _shards(1)  # the damaged local copy was dropped
        del ck
        again = c.restore("job", 0, step=1)  # the good copy is local again
        assert again.tier == "local" and _got(again) == _shards(1)


def test_always_with_no_good_copy_left_is_data_loss(daemon_factory) -> None:
    d = daemon_factory()  # no peer, no persistent tier: the local copy is the only one
    with d.client(verify="always") as c:
        c.save("job", 1, 0, 1, _shards(1)).result(60)
    flip_bit(next(rank_dir(d.local_dir, "job", 1, 0).glob("model.*")), 99)
    with d.client(verify=False) as c:  # the damage is real: unverified, it would be returned
        ck = c.restore("job", 0, step=1)
        assert _got(ck)["model"] != _shards(1)["model"]
        del ck
    with d.client(verify="always") as c, pytest.raises(tierckpt.DataLossError):
        c.restore("job", 0, step=1)
