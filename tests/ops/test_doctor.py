"""``tierckpt doctor`` against real daemons: every check passes on a healthy node, and each kind of
problem stops it at that check with a hint and a non-zero exit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tierckpt.cli.doctor import Problem, _check_peers
from tierckpt.v1 import tierckpt_pb2 as pb

from ..harness import Cluster, free_port, wait_until

# A capacity the machine can hold (the default, the whole tmpfs, may exceed the memory available on
# a loaded machine, which doctor rightly reports): the tests of later checks pass this one.
CAP = ("--local-capacity", str(2**30))
CHECKS = ["socket", "daemon", "clock", "fast path", "capacity", "persistent tier", "peers"]


def doctor(address: str, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "tierckpt.cli", "--address", address, "doctor", *extra],
                          capture_output=True, text=True, timeout=120)


def lines(p: subprocess.CompletedProcess) -> dict[str, str]:
    """check -> 'ok ...' or 'FAIL ...'"""
    got = {}
    for line in p.stdout.splitlines():
        status, _, rest = line.partition("  ")
        if status.strip() in ("ok", "FAIL"):
            got[rest.strip().split(":", 1)[0]] = status.strip()
    return got


def test_a_healthy_cluster_passes_every_check(daemon_factory, scratch: Path) -> None:
    cl = Cluster(daemon_factory, 2, extra=("--persistent", (scratch / "store").as_uri(), *CAP))
    d = cl.d["n0"]
    with d.client() as c:
        wait_until(lambda: all(p.clock_skew_known for p in c.status().peers), what="n0 measured n1's clock")
        st = c.status()
    assert abs(st.peers[0].clock_skew_seconds) < 1.0 and abs(st.now_unix - time.time()) < 5
    p = doctor(d.address)
    assert p.returncode == 0, p.stdout + p.stderr
    assert lines(p) == dict.fromkeys(CHECKS, "ok"), p.stdout
    assert "all checks passed" in p.stdout and "shares the daemon's local dir" in p.stdout
    assert "1 up, clocks within" in p.stdout, p.stdout


def test_no_socket_is_exit_3_with_a_hint(scratch: Path) -> None:
    p = doctor(f"unix://{scratch}/nothing.sock")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "FAIL  socket: no socket at" in p.stdout and "hint: start tierckptd" in p.stdout


def test_a_plain_file_is_not_a_socket(scratch: Path) -> None:
    (scratch / "file.sock").write_text("")
    p = doctor(f"unix://{scratch}/file.sock")
    assert p.returncode == 3 and "is not a socket" in p.stdout, p.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user")
def test_a_user_outside_the_socket_group_is_told_which_group(daemon_factory, scratch: Path) -> None:
    d = daemon_factory("n0")
    os.chmod(scratch, 0o755)  # let the other user reach the socket's directory (mode 0660: not the socket)
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    probe = subprocess.run([*nobody, sys.executable, "-c", "import tierckpt"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("the venv is not readable by uid 65534 here")
    p = doctor(d.address, prefix=nobody)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "may not be opened by this user" in p.stdout and "hint: add the user to group" in p.stdout, p.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a mount namespace")
def test_a_process_that_cannot_see_the_local_dir_is_told_it_streams(daemon_factory) -> None:
    d = daemon_factory("n0")
    # In a private mount namespace an empty tmpfs hides the daemon's local dir: what a trainer in a
    # container without the hostPath mount sees.
    hide = ("unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs none "{d.local_dir}" && exec "$0" "$@"')
    probe = subprocess.run([*hide, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")
    p = doctor(d.address, prefix=hide)
    assert p.returncode == 1, p.stdout + p.stderr
    assert lines(p) == {"socket": "ok", "daemon": "ok", "clock": "ok", "fast path": "FAIL"}, p.stdout
    assert "stream over gRPC" in p.stdout and "hint: run the trainer on the daemon's node" in p.stdout


def test_capacity_beyond_the_file_system_is_a_problem(daemon_factory, scratch: Path) -> None:
    free = shutil.disk_usage(scratch).free
    d = daemon_factory("n0", args=("--local-capacity", str(free * 4)))
    p = doctor(d.address)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL  capacity: local_capacity is" in p.stdout and "hint: lower local_capacity" in p.stdout, p.stdout


def test_a_degraded_persistent_tier_is_a_problem(daemon_factory, scratch: Path) -> None:
    (scratch / "plain-file").write_text("")
    d = daemon_factory("n0", args=("--persistent", (scratch / "plain-file" / "store").as_uri(), *CAP))
    p = doctor(d.address)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL  persistent tier:" in p.stdout and "plain-file" in p.stdout and "hint: check the daemon's" \
        in p.stdout, p.stdout


def test_a_down_peer_is_named(daemon_factory) -> None:
    port = free_port()
    d = daemon_factory("n0", port=port, args=("--peers", f"n0=127.0.0.1:{port},n1=127.0.0.1:{free_port()}",
                                              "--replicas", "1", *CAP))
    p = doctor(d.address)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL  peers: 1 of 1 peers down: n1 at 127.0.0.1:" in p.stdout, p.stdout


def test_peer_clock_skew_beyond_the_limit_is_a_problem() -> None:
    """Skew cannot be made between two daemons on one machine: the check alone, on a status as a
    daemon reports it."""
    st = pb.StatusResponse(peers=[pb.PeerStatus(node_id="n1", up=True, clock_skew_seconds=0.2, clock_skew_known=True),
                                  pb.PeerStatus(node_id="n2", up=True, clock_skew_seconds=-3.5,
                                                clock_skew_known=True)])
    with pytest.raises(Problem, match=r"n2 -3.50 s") as e:
        _check_peers(st, 1.0)
    assert "n1" not in str(e.value) and "chrony" in e.value.hint
    assert _check_peers(st, 5.0) == "2 up, clocks within 3.500 s"
    st.peers[1].clock_skew_known = False  # an older peer: not judged
    assert _check_peers(st, 1.0) == "2 up, clocks within 0.200 s"


def test_a_ram_disk_larger_than_the_memory_available_is_a_problem(monkeypatch, scratch: Path) -> None:
    """The memory side of the capacity check, on the real local dir but a stated amount of memory
    (how much a machine has free cannot be arranged in a test)."""
    from tierckpt.cli import doctor as doc

    monkeypatch.setattr(doc, "_fstype", lambda path: "tmpfs")
    monkeypatch.setattr(doc, "_mem_available", lambda: 2**30)
    st = pb.StatusResponse(local_dir=str(scratch), used_bytes=0, capacity_bytes=2**20)
    assert "RAM disk with 1.0 GiB of memory available" in doc._check_capacity(st, True)
    st.capacity_bytes = min(2 * 2**30, shutil.disk_usage(scratch).free)
    with pytest.raises(Problem, match="only 1.0 GiB of memory is available"):
        doc._check_capacity(st, True)
