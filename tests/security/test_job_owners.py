"""Jobs have owners (DESIGN.md, trust model), against real daemons on loopback: a job belongs to
the identity that first saved it (a tenant's Unix socket, or a TCP client certificate); another
identity cannot save it, and latest, availability, restore, retention and replication ignore
steps another identity wrote. A node cannot push copies of another node's ranks while that node
is up, and a copy never supersedes a trainer's open save."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import tierckpt
from tierckpt.errors import NotFoundError, PermissionDeniedError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc
from tierckptd.local.manifest import Manifest
from tierckptd.testing import free_port

from ..certs import make_pki, tls_args
from ..harness import wait_until
from ._util import snapshot
from .test_peer_identity import _code, _manifest, _stub


@pytest.fixture
def shared(daemon_factory, tmp_path: Path):
    """One node serving the default tenant on its socket and tenant ``teamb`` on another."""
    sock = tmp_path / "teamb.sock"
    d = daemon_factory("n0", args=("--tenant-sockets", f"teamb={sock}:{os.getgid()}:0600", "--keep-local", "2"))
    assert (os.stat(sock).st_mode & 0o777) == 0o600
    return d, f"unix://{sock}"


def _steps(c: tierckpt.Client, job: str) -> list[int]:
    return [i.step for i in c.list(job)]


def test_another_tenant_cannot_save_see_or_restore_a_job(shared) -> None:
    d, b_addr = shared
    with d.client() as a, tierckpt.Client(b_addr) as b:
        a.save("llama", 1, 0, 1, {"w": b"A" * 1000}).result(30)
        with pytest.raises(PermissionDeniedError, match="llama"):
            b.save("llama", 1_000_000, 0, 1, {"w": b"B" * 1000}).result(30)
        assert b.latest("llama") is None
        assert _steps(b, "llama") == []
        with pytest.raises((PermissionDeniedError, NotFoundError)):
            b.restore("llama", 0)
        # teamb's own jobs are its own: the default tenant neither sees nor takes them.
        b.save("mistral", 5, 0, 1, {"w": b"M" * 1000}).result(30)
        assert b.latest("mistral") == 5 and a.latest("mistral") is None
        with pytest.raises(PermissionDeniedError, match="mistral"):
            a.save("mistral", 6, 0, 1, {"w": b"x" * 1000}).result(30)
        with pytest.raises(PermissionDeniedError):
            a.delete_step("mistral", 5)
        assert a.latest("llama") == 1
        assert bytes(a.restore("llama", 0).shards["w"]) == b"A" * 1000


def test_a_single_tenant_node_needs_no_configuration(daemon_factory) -> None:
    d = daemon_factory("n0")
    with d.client() as c, tierckpt.Client(f"{d.tcp_address}") as tcp:  # insecure TCP: the default tenant too
        c.save("j", 1, 0, 1, {"w": b"1" * 100}).result(30)
        tcp.save("j", 2, 0, 1, {"w": b"2" * 100}).result(30)
        assert c.latest("j") == 2 == tcp.latest("j")
    man = Manifest.from_json((d.local_dir / "jobs" / "j" / f"{2:020d}" / "rank-0000000" / "manifest.json").read_bytes())
    assert man.job_owner == "" and b"job_owner" not in man.to_json()  # manifests as before owners


def test_cross_node_squatting_changes_nothing_for_the_owner(daemon_factory) -> None:
    """A trainer of another tenant on n2 saves the owner's job at huge steps: n0's trainer still
    restores its own bytes, n0 refuses n2's copies (its ring successor), and retention keeps the
    owner's steps on n0 and on n1 (which holds n0's replicas)."""
    ids = ("n0", "n1", "n2")
    ports = {n: free_port() for n in ids}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    common = ("--peers", peers, "--replicas", "1", "--keep-local", "2", "--knobs", "refresh_interval=0.2")
    ds = {n: daemon_factory(n, port=ports[n], args=(*common, *(("--socket-tenant", "evil") if n == "n2" else ())))
          for n in ids}
    with ds["n0"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} == {"n1", "n2"}, what="n0 sees n1, n2")
        for step in (1, 2):
            c.save("llama", step, 0, 1, {"w": bytes([step]) * 4096}).wait("peer", timeout=60)
    with ds["n2"].client() as evil:
        for step in (1_000_000, 1_000_001):
            fut = evil.save("llama", step, 0, 1, {"w": b"\xee" * 4096})
            fut.result(30)
            with pytest.raises(Exception):  # n0, n2's successor, refuses the copy: never "peer"-safe
                fut.wait("peer", timeout=5)
        assert evil.latest("llama") == 1_000_001  # its own steps, as far as it can see
        evil.delete_step("llama", 2)  # through n2, cluster-wide: only copies evil saved may go
        evil.delete_step("llama", 1)
    for n in ("n0", "n1"):
        with ds[n].client() as c:
            assert c.latest("llama") == 2
            assert _steps(c, "llama") == [1, 2]
            assert [a.step for a in c.availability("llama", 0)] == [1, 2]
    held = {int(p.name) for p in (ds["n0"].local_dir / "jobs" / "llama").iterdir() if p.name.isdigit()}
    assert held == {1, 2}
    with ds["n0"].client() as c:
        assert bytes(c.restore("llama", 0).shards["w"]) == b"\x02" * 4096


@pytest.fixture
def ring(daemon_factory, tmp_path: Path):
    pki = make_pki(tmp_path, ["n0", "n1", "n2"])
    ports = {n: free_port() for n in ("n0", "n1", "n2")}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    ds = {n: daemon_factory(n, port=ports[n], args=("--peers", peers, "--replicas", "1", "--knobs",
                                                    "refresh_interval=0.2,owner_grace=600", *tls_args(pki[n])))
          for n in ("n0", "n1", "n2")}
    with ds["n1"].client() as c:
        wait_until(lambda: {p.node_id for p in c.status().peers if p.up} >= {"n0", "n2"}, what="n1 sees n0, n2")
    return ds, pki


def test_a_node_cannot_replace_a_live_owners_copy(ring) -> None:
    ds, pki = ring
    n1 = ds["n1"]
    with ds["n0"].client() as c:
        c.save("j", 7, 0, 1, {"w": b"real"}).wait("peer", timeout=60)
    with n1.client() as c:
        wait_until(lambda: c.list("j") and 7 in _steps(c, "j"), what="n1 lists j")
    before = snapshot(n1.local_dir)
    ch, stub = _stub(n1, pki["n2"])
    with ch:  # n2, with its own certificate, pushes a "newer" copy of n0's rank while n0 is up
        with pytest.raises(grpc.RpcError) as err:
            stub.PrepareReplica(ppb.PrepareReplicaRequest(sender="n2", manifest_json=_manifest("n0")), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "sender" in err.value.details()
    assert snapshot(n1.local_dir) == before


def test_an_inbound_copy_never_supersedes_an_open_save(ring) -> None:
    ds, pki = ring
    n1 = ds["n1"]
    ch, stub = _stub(n1, pki["n0"])
    with grpc.insecure_channel(n1.address) as local, ch:
        trainer = pb_grpc.TierckptStub(local)
        begun = trainer.BeginSave(pb.BeginSaveRequest(job="j", step=7, rank=0, world_size=1,
                                                      transfer=pb.TRANSFER_STREAM,
                                                      shards=[pb.ShardSpec(name="w", size=4)]), timeout=10)
        # n0's replica of the same rank arrives while n1's trainer has it open: refused, not superseding.
        assert _code(stub.PrepareReplica, ppb.PrepareReplicaRequest(sender="n0", manifest_json=_manifest("n0")),
                     timeout=10) == grpc.StatusCode.FAILED_PRECONDITION
        trainer.AbortSave(pb.AbortSaveRequest(save_id=begun.save_id), timeout=10)
    with n1.client() as c:  # the trainer's own save still goes through
        c.save("j", 7, 0, 1, {"w": b"mine"}).result(30)
        assert bytes(c.restore("j", 0, step=7).shards["w"]) == b"mine"


def test_the_object_store_keeps_a_job_for_its_first_owner(daemon_factory, tmp_path: Path) -> None:
    """Two nodes drain to one bucket: a step of the same job saved by another identity is never
    drained over the owner's, and neither identity's latest/restore counts the other's steps."""
    store = f"file://{tmp_path / 'bucket'}"
    common = ("--persistent", store, "--persist-every", "1")
    a = daemon_factory("a", args=common)
    b = daemon_factory("b", args=(*common, "--socket-tenant", "teamb"))
    with a.client() as ca:
        ca.save("llama", 1, 0, 1, {"w": b"A" * 2048}).wait("persistent", timeout=60)
    with b.client() as cb:
        fut = cb.save("llama", 9, 0, 1, {"w": b"B" * 2048})
        fut.result(30)
        with pytest.raises(Exception, match="owned by"):
            fut.wait("persistent", timeout=30)
        assert cb.latest("llama") == 9  # its own local step; the owner's step 1 in the store is not its
        with pytest.raises((NotFoundError, PermissionDeniedError)):
            cb.restore("llama", 0, step=1)
    manifests = sorted(p.name for p in (tmp_path / "bucket").rglob("*") if "manifest" in p.name)
    assert manifests and all("00000000000000000009" not in m for m in manifests)
    a.kill()
    a.wipe()
    a = daemon_factory("a2", args=common)  # a fresh node of the default tenant: only the owner's step
    with a.client() as ca:
        assert ca.latest("llama") == 1
        assert bytes(ca.restore("llama", 0).shards["w"]) == b"A" * 2048


@pytest.mark.parametrize("value, named", [
    ("teamb", "tenant_sockets"),
    ("teamb=relative.sock:100", "tenant_sockets.teamb"),
    ("teamb=/run/b.sock:", "tenant_sockets.teamb"),
    ("teamb=/run/b.sock:100:999", "tenant_sockets.teamb"),
    ("bad name=/run/b.sock:100", "tenant_sockets name"),
    ("b=/run/b.sock:100,c=/run/b.sock:100", "tenant_sockets.c"),
])
def test_bad_tenant_sockets_are_refused_naming_the_field(value: str, named: str) -> None:
    from tierckptd.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config({}, {"node_id": "n0", "tenant_sockets": value})
    with pytest.raises(ConfigError, match="socket_tenant"):
        load_config({}, {"node_id": "n0", "socket_tenant": "no spaces"})
