"""Fuzz every gRPC method of both services (tierckpt.v1.Tierckpt, tierckpt.v1.Peer) and the bulk
port with hypothesis, directly (not through the client library): generated names, sizes, dtypes,
shapes, steps, ranks, generations, tickets and JSON, truncated bytes and out-of-order calls.

Each request must get a precise status code (never UNKNOWN or INTERNAL for bad input: the accepted
outcomes are listed in ACCEPTED and BULK_ACCEPTED), and after each fuzz test the daemon must be up,
its log free of tracebacks, and the committed store byte for byte unchanged (each test checks this
itself, so it holds when a test runs alone). The Peer service is
fuzzed over TCP: a daemon on loopback without TLS (``--insecure-listen``) takes a caller that
names a cluster member (n0, n1) as that peer (certificates are only checked under mTLS); other
callers get PERMISSION_DENIED. ``TIERCKPT_FUZZ_EXAMPLES`` (default 600 per test: 1,200 requests per run over
the gRPC and bulk tests, about 15 s) sets the number of generated examples; ``make test-long``
runs 5,000 per test.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierckpt.common import checksum
from tierckpt.v1 import peer_pb2, tierckpt_pb2
from tierckptd.testing import free_port

from ..security._util import snapshot
from ._util import save

EXAMPLES = int(os.environ.get("TIERCKPT_FUZZ_EXAMPLES", "600"))
# A precise answer to a request: OK, or the code of a typed tierckpt error (tierckpt.common.status)
# that bad input can earn. Never UNKNOWN or INTERNAL (an unhandled error), nor UNAVAILABLE (the
# daemon is up), CANCELLED or the rest.
ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED}
# Methods that wait (for a tier, until the deadline when the request names none): the client's
# deadline is a correct end of them. Any other method must answer well within CALL_TIMEOUT; a
# DEADLINE_EXCEEDED of its own is accepted only when the daemon raised it (its own message).
WAITING = {"/tierckpt.v1.Tierckpt/WaitTier", "/tierckpt.v1.Tierckpt/PersistStep"}
WAIT_TIMEOUT, CALL_TIMEOUT = 3.0, 30.0
GRPC_DEADLINE = "Deadline Exceeded"  # grpc's own details of a client-side deadline
# The bulk port answers {"ok": false, "code": ...} with a typed error's code, or hangs up on bytes
# that are not a request ("closed": orderly, "reset": aborted).
BULK_ACCEPTED = {"OK", "closed", "reset"} | {c.name for c in ACCEPTED if c is not grpc.StatusCode.OK}
SIZES = {"w": 4096, "b": 10}
FUZZ_SETTINGS = dict(deadline=None, derandomize=False, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                            HealthCheck.data_too_large])

# ----------------------------------------------------------------------------- value strategies

names = st.one_of(
    st.sampled_from(["fz", "w", "b", "n1", "n0", "job", "a" * 128, "a" * 256, "", ".", "..", "../etc", "a/b",
                     "/abs", "x\x00y", "ü", " ", "-lead", ".hidden", "a..b", "CON", "manifest.json"]),
    st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
    st.text(max_size=40),
)
tokens = st.one_of(st.sampled_from(["", "x", "0" * 24, "\x00", "a" * 5000]), st.text(max_size=30),
                   st.binary(max_size=24).map(lambda b: b.hex()))
dtypes = st.sampled_from(["", "float32", "bfloat16", "int8", "uint64", "bool", "complex128", "float", "<f4",
                          "object", "V", "S10", "U3", "x" * 100, "float32\x00"])


def ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    edges = [v for v in (lo, hi, 0, 1, 2, 3, 7, 4096, 1 << 20, 1 << 31, (1 << 32) - 1, 1 << 40, -1)
             if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -10), min(hi, 10)))


doubles = st.one_of(st.sampled_from([0.0, -1.0, 1e-9, 0.5, 1e300, float("nan"), float("inf"), float("-inf")]),
                    st.floats(allow_nan=True, allow_infinity=True))


def _manifest_doc(data: st.DataObject | None = None) -> st.SearchStrategy[Any]:
    shard = st.fixed_dictionaries({
        "name": names, "size": st.one_of(ints(64, True), st.text(max_size=3)),
        "checksum": st.one_of(st.just(checksum.digest(b"")), tokens), "dtype": dtypes,
        "shape": st.lists(ints(64, True), max_size=3), "file": names, "codec": st.sampled_from(["", "zz", "identity"])})
    return st.fixed_dictionaries({
        "format": st.sampled_from([1, 2, "1", None]),
        "checksum_algorithm": st.sampled_from([checksum.ALGORITHM, "md5"]),
        "job": names, "step": ints(64, True), "rank": ints(32, True), "world_size": ints(32, True),
        "node": st.sampled_from(["n1", "n0", "zz", ""]), "generation": tokens,
        "metadata_json": st.one_of(st.just("{}"), st.integers()), "created": doubles,
        "shards": st.one_of(st.lists(shard, max_size=3), st.integers(), st.just([[1]]))})


json_texts = st.one_of(
    st.just(""), st.just("{}"), st.just("[]"), st.just("null"), st.just("1"), st.just('"s"'),
    st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 50_000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.integers(1, 3 << 20).map(lambda n: '{"a": "' + "x" * n + '"}'),
    st.text(max_size=50),
    st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=5),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                 max_leaves=10).map(json.dumps),
    _manifest_doc().map(json.dumps),
)


def _field(f: Any, depth: int) -> st.SearchStrategy[Any]:
    if f.type == FD.TYPE_MESSAGE:
        one = message_of(f.message_type._concrete_class, depth + 1) if depth < 2 else st.none()
    elif f.type == FD.TYPE_STRING:
        one = json_texts if f.name.endswith("_json") else tokens if f.name in ("save_id", "ticket", "generation",
                                                                               "corrupt_generation") \
            else dtypes if f.name == "dtype" else names
    elif f.type == FD.TYPE_BYTES:
        one = st.binary(max_size=5000)
    elif f.type == FD.TYPE_BOOL:
        one = st.booleans()
    elif f.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        one = doubles if f.type == FD.TYPE_DOUBLE else st.floats(width=32)
    elif f.type == FD.TYPE_ENUM:
        one = st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), ints(32, True))
    else:
        wide = (FD.TYPE_INT64, FD.TYPE_UINT64, FD.TYPE_SINT64, FD.TYPE_FIXED64, FD.TYPE_SFIXED64)
        bits = 64 if f.type in wide else 32
        one = ints(bits, f.type in (FD.TYPE_INT64, FD.TYPE_INT32, FD.TYPE_SINT64, FD.TYPE_SINT32, FD.TYPE_SFIXED64,
                                    FD.TYPE_SFIXED32))
    if f.is_repeated:
        return st.lists(one, max_size=4 if depth == 0 else 2)
    return st.one_of(st.none(), one)  # None: the field left unset


def message_of(cls: type, depth: int = 0) -> st.SearchStrategy[Any]:
    fields = cls.DESCRIPTOR.fields

    def build(values: list[Any]) -> Any:
        msg = cls()
        for f, v in zip(fields, values):
            if v is None:
                continue
            target = getattr(msg, f.name)
            if f.is_repeated:
                if f.type == FD.TYPE_MESSAGE:
                    target.extend([x for x in v if x is not None])
                else:
                    target.extend(v)
            elif f.type == FD.TYPE_MESSAGE:
                target.CopyFrom(v)
            else:
                setattr(msg, f.name, v)
        return msg

    return st.tuples(*(_field(f, depth) for f in fields)).map(lambda vs: build(list(vs)))


# ----------------------------------------------------------------------------- the daemon under fuzz

SERVICES = {"tierckpt.v1.Tierckpt": tierckpt_pb2, "tierckpt.v1.Peer": peer_pb2}


def _methods() -> list[tuple[str, Any, bool, bool]]:
    out = []
    for service, mod in SERVICES.items():
        for m in mod.DESCRIPTOR.services_by_name[service.split(".")[-1]].methods:
            out.append((f"/{service}/{m.name}", m.input_type._concrete_class, m.client_streaming,
                        m.server_streaming))
    return out


# Well-formed requests to these legitimately delete what the store holds (tierckpt rm); their
# refusals of bad input are tested in tests/ops/test_data_management.py.
DELETING = {"/tierckpt.v1.Tierckpt/DeleteStep", "/tierckpt.v1.Peer/DeleteStepCopies"}
METHODS = [m for m in _methods() if m[0] not in DELETING]


class Target:
    """The fuzzed daemon, its channel and the snapshot of its committed store."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.channel = grpc.insecure_channel(daemon.tcp_address)
        self.bulk_port = 0
        self.before = self.committed()
        self.sent = 0  # requests answered (gRPC calls and bulk exchanges)

    def committed(self) -> dict[str, Any]:
        snap = snapshot(self.daemon.local_dir)
        # policies/: a well-formed SetJobPolicy legitimately writes a job's policy file
        return {k: v for k, v in snap.items() if not k.startswith(("staging", "recycle", "reserve", "policies"))}

    def log_size(self) -> int:
        return self.daemon.log_path.stat().st_size

    def call(self, path: str, request: bytes | list[bytes], client_streaming: bool,
             server_streaming: bool) -> tuple[grpc.StatusCode, str]:
        """The status code of the answer and its details."""
        ident = lambda b: b  # noqa: E731 (raw bytes on the wire)
        timeout = WAIT_TIMEOUT if path in WAITING else CALL_TIMEOUT
        self.sent += 1
        try:
            if client_streaming:
                self.channel.stream_unary(path, ident, ident)(iter(request), timeout=timeout)
            elif server_streaming:
                for _ in self.channel.unary_stream(path, ident, ident)(request, timeout=timeout):
                    pass
            else:
                self.channel.unary_unary(path, ident, ident)(request, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def assert_intact(self, log_from: int) -> None:
        """The daemon is up, the committed store unchanged and restorable byte for byte, and the
        log written since ``log_from`` holds no traceback (an error the daemon did not expect)."""
        from ._util import shards_for

        assert self.daemon.alive(), self.daemon.log_tail()
        assert self.committed() == self.before
        with self.daemon.client() as c:
            for step in (1, 2):
                ck = c.restore("fz", rank=0, step=step)
                assert {n: bytes(v) for n, v in ck.shards.items()} == shards_for("fz", step, 0, SIZES)
        with open(self.daemon.log_path, "rb") as f:
            f.seek(log_from)
            log = f.read().decode(errors="replace")
        assert "Traceback" not in log, log[-5000:]


@pytest.fixture(scope="module", params=["replicas:1", "parity:4+1", "parity:4+2"])
def target(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Target]:
    from tierckptd.testing import Daemon, scratch_dir

    root = scratch_dir("tck-fz-")
    port = free_port()
    redundancy = ("--replicas", "1") if request.param == "replicas:1" else ("--redundancy", request.param)
    d = Daemon(root, "n0", port=port, args=(
        "--peers", f"n0=127.0.0.1:{port},n1=127.0.0.1:{free_port()}", *redundancy,
        "--knobs=rpc_timeout=0.5,fanout_deadline=0.5,refresh_interval=0.5"))
    d.start()
    with d.client() as c:
        for step in (1, 2):
            save(c, "fz", step, 0, SIZES)
    t = Target(d)
    resp = t.channel.unary_unary("/tierckpt.v1.Peer/Hello")(
        peer_pb2.HelloRequest(node_id="n1").SerializeToString(), timeout=5)
    t.bulk_port = peer_pb2.HelloResponse.FromString(resp).bulk_port
    yield t
    t.channel.close()
    d.kill()
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def _check(matrix: Any, path: str, code: grpc.StatusCode, details: str) -> None:
    matrix.code(code.name)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert path in WAITING or details != GRPC_DEADLINE, f"{path}: no answer within {CALL_TIMEOUT} s"
        return
    assert code in ACCEPTED, f"{path}: {code} {details}"


@st.composite
def grpc_requests(draw: st.DrawFn) -> tuple[str, Any, bool, bool]:
    path, cls, cs, ss = draw(st.sampled_from(METHODS))
    how = draw(st.sampled_from(["message", "message", "message", "truncated", "garbage"]))
    msgs = draw(st.lists(message_of(cls), min_size=1, max_size=3 if cs else 1))
    raw = [m.SerializeToString() for m in msgs]
    if how == "truncated":
        raw = [r[: draw(st.integers(0, max(0, len(r) - 1)))] for r in raw]
    elif how == "garbage":
        raw = [draw(st.binary(min_size=1, max_size=64)) for _ in raw]
    return path, (raw if cs else raw[0]), cs, ss


@settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)
@given(req=grpc_requests())
def _fuzz_grpc(target: Target, matrix: Any, req: tuple[str, Any, bool, bool]) -> None:
    path, body, cs, ss = req
    code, details = target.call(path, body, cs, ss)
    _check(matrix, path, code, details)


def test_fuzz_grpc_methods(target: Target, matrix: Any) -> None:
    log_from, sent = target.log_size(), target.sent
    _fuzz_grpc(target, matrix)
    assert target.sent - sent >= EXAMPLES, "hypothesis ran fewer examples than asked"
    target.assert_intact(log_from)


# ----------------------------------------------------------------------------- the bulk port

@st.composite
def bulk_exchanges(draw: st.DrawFn) -> list[bytes]:
    doc = draw(st.one_of(
        st.fixed_dictionaries({"v": st.sampled_from([1, 1, 1, 2, "1", None]),
                               "op": st.sampled_from(["put", "get", "x", None]),
                               "ticket": tokens, "shard": names,
                               "offset": st.one_of(ints(64, True), st.none(), st.text(max_size=3)),
                               "chunk": st.one_of(ints(64, True), st.none()),
                               "stride": st.one_of(ints(64, True), st.none())}),
        st.recursive(st.none() | st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=3), max_leaves=5),
    ))
    body = json.dumps(doc).encode()
    frame = struct.pack(">I", len(body)) + body
    how = draw(st.sampled_from(["frame", "frame", "truncated", "huge-length", "garbage", "frame+bytes", "nested"]))
    if how == "truncated":
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif how == "huge-length":
        frame = struct.pack(">I", draw(st.sampled_from([0, (64 << 10) + 1, 0xFFFFFFFF]))) + body
    elif how == "garbage":
        frame = draw(st.binary(min_size=1, max_size=100))
    elif how == "frame+bytes":
        frame += draw(st.binary(max_size=5000))
    elif how == "nested":
        body = b"[" * 100_000
        frame = struct.pack(">I", len(body)) + body
    return [frame]


def _bulk(port: int, frames: list[bytes]) -> str:
    """Send frames; return the status code named in the daemon's answer, or how the connection ended."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            for f in frames:
                s.sendall(f)
            s.shutdown(socket.SHUT_WR)
            head = b""
            while len(head) < 4:
                chunk = s.recv(4 - len(head))
                if not chunk:
                    return "closed"
                head += chunk
            (n,) = struct.unpack(">I", head)
            body = b""
            while len(body) < min(n, 1 << 16):
                chunk = s.recv(n - len(body))
                if not chunk:
                    break
                body += chunk
        except TimeoutError:
            return "timeout"
        except OSError:  # reset, broken pipe, not connected: the daemon hung up on garbage
            return "reset"
    doc = json.loads(body)
    return "OK" if doc.get("ok") else str(doc.get("code"))


@settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)
@given(frames=bulk_exchanges())
def _fuzz_bulk(target: Target, matrix: Any, frames: list[bytes]) -> None:
    target.sent += 1
    outcome = _bulk(target.bulk_port, frames)
    matrix.code(f"bulk:{outcome}")
    assert outcome in BULK_ACCEPTED, outcome


def test_fuzz_bulk_port(target: Target, matrix: Any) -> None:
    log_from, sent = target.log_size(), target.sent
    _fuzz_bulk(target, matrix)
    assert target.sent - sent >= EXAMPLES, "hypothesis ran fewer examples than asked"
    target.assert_intact(log_from)
