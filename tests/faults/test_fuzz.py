"""Fuzz every gRPC method of both services (tierckpt.v1.Tierckpt, tierckpt.v1.Peer) and the bulk
port with hypothesis, directly (not through the client library): generated names, sizes, dtypes,
shapes, steps, ranks, generations, tickets and JSON, truncated bytes and out-of-order calls.

Each request must get a precise status code (never UNKNOWN or INTERNAL for bad input), the daemon
must stay up, and the committed store must stay byte for byte unchanged. The Peer service is
fuzzed over TCP: a daemon on loopback without TLS takes any caller as a peer (identity is only
checked under mTLS). ``TIERCKPT_FUZZ_EXAMPLES`` (default 600 per test: 1,200 requests per run over
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
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
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

    def committed(self) -> dict[str, Any]:
        snap = snapshot(self.daemon.local_dir)
        # policies/: a well-formed SetJobPolicy legitimately writes a job's policy file
        return {k: v for k, v in snap.items() if not k.startswith(("staging", "recycle", "policies"))}

    def call(self, path: str, request: bytes | list[bytes], client_streaming: bool, server_streaming: bool,
             timeout: float = 3.0) -> grpc.StatusCode:
        ident = lambda b: b  # noqa: E731 (raw bytes on the wire)
        try:
            if client_streaming:
                self.channel.stream_unary(path, ident, ident)(iter(request), timeout=timeout)
            elif server_streaming:
                for _ in self.channel.unary_stream(path, ident, ident)(request, timeout=timeout):
                    pass
            else:
                self.channel.unary_unary(path, ident, ident)(request, timeout=timeout)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    from tierckptd.testing import Daemon, scratch_dir

    root = scratch_dir("tck-fz-")
    port = free_port()
    d = Daemon(root, "n0", port=port, args=(
        "--peers", f"n0=127.0.0.1:{port},n1=127.0.0.1:{free_port()}", "--replicas", "1",
        "--knobs=rpc_timeout=0.5,fanout_deadline=0.5,refresh_interval=0.5"))
    d.start()
    with d.client() as c:
        for step in (1, 2):
            save(c, "fz", step, 0, SIZES)
    t = Target(d)
    resp = t.channel.unary_unary("/tierckpt.v1.Peer/Hello")(b"", timeout=5)
    t.bulk_port = peer_pb2.HelloResponse.FromString(resp).bulk_port
    yield t
    t.channel.close()
    d.kill()
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def _check(target: Target, matrix: Any, what: str, code: grpc.StatusCode) -> None:
    matrix.code(code.name)
    assert code not in BAD, f"{what}: {code}"


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
def test_fuzz_grpc_methods(target: Target, matrix: Any, req: tuple[str, Any, bool, bool]) -> None:
    path, body, cs, ss = req
    code = target.call(path, body, cs, ss)
    _check(target, matrix, path, code)


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
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
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
def test_fuzz_bulk_port(target: Target, matrix: Any, frames: list[bytes]) -> None:
    outcome = _bulk(target.bulk_port, frames)
    matrix.code(f"bulk:{outcome}")
    assert outcome not in ("UNKNOWN", "INTERNAL", "timeout"), outcome


# ----------------------------------------------------------------------------- afterwards

def test_fuzzed_daemon_is_up_and_its_store_unchanged(target: Target, matrix: Any) -> None:
    assert target.daemon.alive(), target.daemon.log_tail()
    assert target.committed() == target.before
    with target.daemon.client() as c:
        for step in (1, 2):
            ck = c.restore("fz", rank=0, step=step)
            from ._util import shards_for

            assert {n: bytes(v) for n, v in ck.shards.items()} == shards_for("fz", step, 0, SIZES)
    log = target.daemon.log_tail(100000)
    assert "Traceback" not in log or "Unexpected" not in log, log[-5000:]
