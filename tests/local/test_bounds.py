"""Resource bounds and file safety of the local store (in-process, no daemon)."""

from __future__ import annotations

import os
import stat

import pytest
from tierckpt.common import checksum as _checksum
from tierckpt.errors import CapacityError, DataLossError, FailedPreconditionError
from tierckptd.local.rules import MIN_CHARGE
from tierckptd.local.store import LocalStore


def _save(store, job, step, data: dict[str, bytes], world=1):
    st = store.begin(job, step, 0, world, [(n, len(b), "", ()) for n, b in data.items()])
    for n, b in data.items():
        with open(st.files[n].path, "r+b") as fh:
            fh.write(b)
    return store.commit(st.save_id, {n: _checksum.digest(b) for n, b in data.items()})[0]


def test_a_reservation_that_cannot_fit_evicts_nothing(scratch):
    evicted = []
    s = LocalStore(scratch / "d", "n0", capacity=60_000, keep_local=5, on_evict=evicted.append)
    s.open()
    _save(s, "j", 1, {"a": b"1" * 20_000})
    _save(s, "j", 2, {"a": b"2" * 20_000})
    with pytest.raises(CapacityError):
        s.begin("j", 3, 0, 1, [("a", 40_000, "", ())])  # needs step 2 gone too: never evictable
    assert s.get("j", 1, 0) is not None and not evicted


def test_zero_byte_shards_are_charged_a_minimum(scratch):
    s = LocalStore(scratch / "d", "n0", capacity=100 * MIN_CHARGE, keep_local=5)
    s.open()
    with pytest.raises(CapacityError):
        s.begin("j", 1, 0, 1, [(f"s{i}", 0, "", ()) for i in range(100)])
    st = s.begin("j", 1, 0, 1, [(f"s{i}", 0, "", ()) for i in range(10)])
    assert s.usage().staging == 0 and s.usage().charged == 11 * MIN_CHARGE
    s.abort(st.save_id)


def test_open_saves_are_bounded(scratch):
    s = LocalStore(scratch / "d", "n0", capacity=1 << 30, max_open_saves=3)
    s.open()
    for step in range(3):
        s.begin("j", step, 0, 1, [("a", 1, "", ())])
    with pytest.raises(CapacityError, match="saves"):
        s.begin("j", 9, 0, 1, [("a", 1, "", ())])
    s.begin("j", 0, 0, 1, [("a", 1, "", ())])  # superseding an open save of the same rank is fine


def test_files_are_0640_and_dirs_0750_whatever_the_umask(scratch):
    old = os.umask(0)
    try:
        s = LocalStore(scratch / "d", "n0", capacity=1 << 30)
        s.open()
        _save(s, "j", 1, {"a": b"x"})
        st = s.begin("j", 2, 0, 1, [("b", 8, "", ())])
    finally:
        os.umask(old)
    staged = st.files["b"].path
    # A staging file is group-writable (trainers in the socket group write into it) ...
    assert stat.S_IMODE(staged.lstat().st_mode) == 0o660
    for p in s.root.rglob("*"):
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o750 if p.is_dir() else 0o660 if p == staged else 0o640), (p, oct(mode))
    # ... and the commit takes group write away before publishing it.
    s.commit(st.save_id, {"b": "c77b3abb6f87acd9"})
    for p in s.root.rglob("*"):
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o750 if p.is_dir() else 0o640), (p, oct(mode))


def test_open_shard_refuses_a_swapped_file(scratch):
    s = LocalStore(scratch / "d", "n0", capacity=1 << 30)
    s.open()
    man = _save(s, "j", 1, {"a": b"abc"})
    fd = s.open_shard(man, "a")
    assert os.pread(fd, 3, 0) == b"abc"
    os.close(fd)
    p = s.shard_path(man, "a")
    p.unlink()
    p.symlink_to("/proc/self/environ")
    with pytest.raises(DataLossError):
        s.open_shard(man, "a")


def test_commit_refuses_a_hard_linked_staging_file(scratch):
    s = LocalStore(scratch / "d", "n0", capacity=1 << 30)
    s.open()
    st = s.begin("j", 1, 0, 1, [("a", 3, "", ())])
    os.link(st.files["a"].path, scratch / "elsewhere")
    with pytest.raises(FailedPreconditionError):
        s.commit(st.save_id, {"a": _checksum.digest(b"\0\0\0")})
    assert s.get("j", 1, 0) is None and s.open_saves() == 0


def test_quarantine_is_counted_and_keeps_the_bytes(scratch):
    s = LocalStore(scratch / "d", "n0", capacity=1 << 30)
    s.open()
    man = _save(s, "j", 1, {"a": b"abc"})
    (s.shard_path(man, "a").parent / "manifest.json").write_bytes(b"{not json")
    s.close()
    again = LocalStore(scratch / "d", "n0", capacity=1 << 30)
    again.open()
    assert again.counters["quarantined"] == 1 and again.get("j", 1, 0) is None
    assert [p.read_bytes() for p in (again.root / "quarantine").rglob("a.*")] == [b"abc"]


def test_directories_keep_the_setgid_group_of_a_shared_root(scratch):
    """The Kubernetes root is 2750, group = the trainers': every directory the store makes keeps
    the setgid bit (and so the group), or trainers could not reach their staging files."""
    others = [g for g in os.getgroups() if g != os.getegid()]
    gid = 2000 if os.geteuid() == 0 else (others[0] if others else None)
    if gid is None:
        pytest.skip("needs root or a second group to chown the root to")
    root = scratch / "d"
    root.mkdir()
    os.chown(root, -1, gid)
    os.chmod(root, 0o2750)
    s = LocalStore(root, "n0", capacity=1 << 30)
    s.open()
    _save(s, "j", 1, {"a": b"x"})
    st = s.begin("j", 2, 0, 1, [("b", 8, "", ())])
    for p in [root, *root.rglob("*")]:
        info = p.lstat()
        assert info.st_gid == gid, p
        if p.is_dir():
            assert stat.S_IMODE(info.st_mode) == 0o2750, (p, oct(info.st_mode))
    assert stat.S_IMODE(st.files["b"].path.lstat().st_mode) == 0o660
