"""TCP clients are bound by their certificate identity: client_jobs (which jobs each certificate
name may use) and max_open_saves_per_client, against a real mTLS daemon; a job a client saved is
its own (SECURITY.md, "Jobs have owners"). Unix-socket callers are not restricted by client_jobs
(the socket's mode, group and tenant are the boundary there). Refusals change nothing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc
from tierckptd.config import ConfigError, load_config

from ..certs import make_pki, tls_args
from ._util import snapshot

CLIENTS = ["trainer-a", "trainer-b", "ops"]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, dict[str, Path]]:
    return make_pki(tmp_path, ["n0", *CLIENTS], sans=("localhost",))


@pytest.fixture
def node(daemon_factory, pki):
    return daemon_factory("n0", args=(*tls_args(pki["n0"]), "--client-jobs", "trainer-a=alpha-*,ops=*",
                                      "--max-open-saves-per-client", "2"))


def _client(node, pki, who: str) -> tierckpt.Client:
    f = pki[who]
    return tierckpt.Client(node.tcp_address, tls_cert=str(f["cert"]), tls_key=str(f["key"]), tls_ca=str(f["ca"]),
                           tls_server_name="localhost", transfer="stream")


def _stub(node, pki, who: str) -> tuple[grpc.Channel, pb_grpc.TierckptStub]:
    f = pki[who]
    creds = grpc.ssl_channel_credentials(f["ca"].read_bytes(), f["key"].read_bytes(), f["cert"].read_bytes())
    ch = grpc.secure_channel(node.tcp_address, creds, options=[("grpc.ssl_target_name_override", "localhost")])
    return ch, pb_grpc.TierckptStub(ch)


def _begin(stub, job: str, step: int) -> pb.BeginSaveResponse:
    return stub.BeginSave(pb.BeginSaveRequest(job=job, step=step, rank=0, world_size=1,
                                              shards=[pb.ShardSpec(name="w", size=4)],
                                              transfer=pb.TRANSFER_STREAM), timeout=10)


def _code(fn, *args, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    return e.value.code()


def test_each_certificate_uses_only_the_jobs_client_jobs_allows(node, pki):
    with node.client() as local:  # the Unix socket: not restricted
        local.save("beta-1", 1, 0, 1, {"w": b"unix"}).result(30)
    with _client(node, pki, "trainer-a") as a:
        a.save("alpha-1", 1, 0, 1, {"w": b"mine"}).result(30)
        assert bytes(a.restore("alpha-1", 0).shards["w"]) == b"mine"
        before = snapshot(node.local_dir)
        for call in (lambda: a.save("beta-1", 2, 0, 1, {"w": b"evil"}).result(30),
                     lambda: a.restore("beta-1", 0), lambda: a.list("beta-1"), lambda: a.latest("beta-1"),
                     lambda: a.delete_step("beta-1", 1)):
            with pytest.raises(tierckpt.PermissionDeniedError, match="beta-1.*trainer-a"):
                call()
        assert snapshot(node.local_dir) == before
        assert [j.job for j in a.status().jobs] == ["alpha-1"]  # other jobs are not listed
    with _client(node, pki, "trainer-b") as b, pytest.raises(tierckpt.PermissionDeniedError, match="client_jobs"):
        b.restore("alpha-1", 0)  # a CA-signed certificate that client_jobs does not name
    with _client(node, pki, "ops") as ops:
        assert {j.job for j in ops.status().jobs} == {"alpha-1", "beta-1"}
        assert bytes(ops.restore("beta-1", 0).shards["w"]) == b"unix"  # ops reads what client_jobs allows
        with pytest.raises(tierckpt.PermissionDeniedError, match="alpha-1.*'trainer-a'"):
            ops.save("alpha-1", 9, 0, 1, {"w": b"ops!"}).result(30)  # but writes only its own jobs
    with node.client() as local, pytest.raises(tierckpt.PermissionDeniedError, match="'trainer-a'"):
        local.save("alpha-1", 9, 0, 1, {"w": b"sock"}).result(30)  # trainer-a's job, whoever asks


def test_open_saves_are_bounded_per_client_and_bound_to_their_client(node, pki):
    ch_a, a = _stub(node, pki, "trainer-a")
    ch_o, ops = _stub(node, pki, "ops")
    with ch_a, ch_o:
        first, _second = _begin(a, "alpha-1", 1), _begin(a, "alpha-1", 2)
        assert _code(_begin, a, "alpha-1", 3) == grpc.StatusCode.RESOURCE_EXHAUSTED
        _begin(ops, "ops-1", 4)  # another identity has its own budget (and may not save alpha-1, trainer-a's)
        assert _code(_begin, ops, "alpha-1", 4) == grpc.StatusCode.PERMISSION_DENIED
        # Another client cannot write, commit or abort trainer-a's save, even knowing its id.
        assert _code(ops.CommitSave, pb.CommitSaveRequest(save_id=first.save_id), timeout=10) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _code(ops.AbortSave, pb.AbortSaveRequest(save_id=first.save_id), timeout=10) == \
            grpc.StatusCode.PERMISSION_DENIED
        a.AbortSave(pb.AbortSaveRequest(save_id=first.save_id), timeout=10)
        _begin(a, "alpha-1", 3)  # room again once one of its saves ended


def test_client_jobs_needs_mtls():
    with pytest.raises(ConfigError, match="client_jobs: needs tls"):
        load_config(overrides={"client_jobs": "trainer-a=alpha-*", "socket": ""})
    with pytest.raises(ConfigError, match="client_jobs: 'a b' is not a certificate name"):
        load_config(overrides={"client_jobs": "a b=x", "tls_cert": "c", "tls_key": "k", "tls_ca": "a"})


def test_a_restricted_client_makes_room_only_among_its_own_jobs(daemon_factory, pki):
    """A reservation by a client that client_jobs restricts never evicts another job's steps:
    it gets RESOURCE_EXHAUSTED instead."""
    node = daemon_factory("n0", args=(*tls_args(pki["n0"]), "--client-jobs", "trainer-a=alpha-*,ops=*",
                                      "--local-capacity", str(1 << 20), "--keep-local", "2"))
    with node.client() as local:
        for step in (1, 2):
            local.save("beta-1", step, 0, 1, {"w": bytes([step]) * 300_000}).result(30)
    with _client(node, pki, "trainer-a") as a, pytest.raises(tierckpt.CapacityError):
        a.save("alpha-1", 1, 0, 1, {"w": b"a" * 500_000}).result(30)
    with node.client() as local:
        assert [i.step for i in local.list("beta-1")] == [1, 2]  # nothing of beta-1 was evicted
    with _client(node, pki, "ops") as ops, pytest.raises(tierckpt.CapacityError):
        # Unrestricted, but beta-1's steps exist nowhere else: no writer evicts another job's only
        # copy (tests/security/test_reservations.py).
        ops.save("alpha-1", 1, 0, 1, {"w": b"o" * 500_000}).result(30)
    with node.client() as local:
        assert [i.step for i in local.list("beta-1")] == [1, 2]
