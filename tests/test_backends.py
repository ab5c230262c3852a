"""One suite for every persistent-tier backend, run against real servers (moto, fake-gcs-server).

Needs the fixtures of :mod:`tests.servers` (``pytest_plugins = ["tests.servers"]`` in conftest, or
``pytest -p tests.servers``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tierckpt.errors import InvalidArgumentError, NotFoundError
from tierckptd.backends import Backend, BackendError, MissingExtraError, open_backend
from tierckptd.config import ConfigError
from tierckptd.fakes import MemoryBackend
from tierckptd.retry import RetryPolicy, call_with_retry

from .servers import BackendTarget, make_backend_target

MiB = 1 << 20
# Fail fast while a server is down: the SDKs' own retries would only slow the outage tests.
_FAST: dict[str, dict[str, Any]] = {"file": {},
                                    "s3": {"sdk_max_attempts": 1, "connect_timeout": 2.0, "read_timeout": 10.0},
         "gs": {"sdk_retry_timeout": 0, "timeout": (2.0, 10.0)}}


@pytest.fixture(params=["file", "s3", "gs", "memory"])
def backend_target(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BackendTarget:
    """The servers' targets plus ``memory`` (:class:`~tierckptd.fakes.MemoryBackend`), so the
    in-memory test double is held to the same contract as the real backends."""
    if request.param == "memory":
        return BackendTarget("memory", "memory://contract/ckpt", {}, None)
    return make_backend_target(request.param, request, tmp_path, monkeypatch)


def _open(url: str) -> Backend:
    return MemoryBackend(url) if url.startswith("memory://") else open_backend(url)


@pytest.fixture
def be(backend_target) -> Iterator[Backend]:
    with _open(backend_target.url) as backend:
        yield backend


def _random_file(path: Path, size: int) -> str:
    """Write ``size`` pseudo-random bytes to ``path``; return their sha256."""
    h = hashlib.sha256()
    block = os.urandom(1 * MiB)
    with open(path, "wb") as f:
        for i in range(0, size, len(block)):
            chunk = block[: size - i] if size - i < len(block) else bytes([i // MiB % 251]) + block[1:]
            f.write(chunk)
            h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


# --- round trips -------------------------------------------------------------------------------


def test_bytes_round_trip_and_overwrite(be: Backend) -> None:
    be.put_bytes("job/1/manifest.json", b'{"a": 1}')
    assert be.get_bytes("job/1/manifest.json") == b'{"a": 1}'
    be.put_bytes("job/1/manifest.json", memoryview(b"replaced"))
    assert be.get_bytes("job/1/manifest.json") == b"replaced"
    be.put_bytes("empty", b"")
    assert be.get_bytes("empty") == b""


def test_get_bytes_refuses_an_object_over_the_limit_without_reading_it(be: Backend) -> None:
    """Issue 27: a reader that knows how large an object may be (a chunk: its size + 1) is never
    handed more; exactly the limit is fine; not retryable."""
    from tierckptd.backends import ObjectTooLargeError

    be.put_bytes("big", b"x" * 100_000)
    assert be.get_bytes("big", limit=100_000) == b"x" * 100_000
    with pytest.raises(ObjectTooLargeError, match="100000 bytes or more|100001 bytes or more") as err:
        be.get_bytes("big", limit=99_999)
    assert not err.value.retryable
    assert be.get_bytes("big") == b"x" * 100_000


def test_small_file_round_trip(be: Backend, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    digest = _random_file(src, 300_000)
    be.put_file("job/1/rank0/model", src)
    dst = tmp_path / "out" / "model"
    dst.parent.mkdir()
    be.get_file("job/1/rank0/model", dst)
    assert _sha256(dst) == digest
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model"]  # no temporary file left over


@pytest.mark.slow
def test_large_file_round_trip(be: Backend, backend_target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """150 MiB: multipart upload / ranged parallel GETs (64 MiB parts) on s3 and gs."""
    ranged: list[int] = []
    if backend_target.kind == "gs":
        from google.cloud.storage import transfer_manager

        real = transfer_manager.download_chunks_concurrently

        def spy(*args: Any, **kwargs: Any) -> Any:
            ranged.append(kwargs["chunk_size"])
            return real(*args, **kwargs)

        monkeypatch.setattr(transfer_manager, "download_chunks_concurrently", spy)
    src = tmp_path / "big.bin"
    digest = _random_file(src, 150 * MiB + 12345)
    try:
        be.put_file("job/7/rank0/optim", src)
        assert be.list("job/7/") == ["job/7/rank0/optim"]
        if backend_target.kind == "s3":  # a multipart upload's ETag ends in -<parts>
            etag = be.client.head_object(Bucket=be.bucket, Key="ckpt/job/7/rank0/optim")["ETag"]  # type: ignore[attr-defined]
            assert etag.endswith('-3"'), etag
        src.unlink()  # keep peak disk use at one copy
        dst = tmp_path / "restored.bin"
        be.get_file("job/7/rank0/optim", dst)
        assert dst.stat().st_size == 150 * MiB + 12345
        assert _sha256(dst) == digest
        assert ranged == ([64 * MiB] if backend_target.kind == "gs" else [])
    finally:
        be.delete(["job/7/rank0/optim"])  # moto keeps objects in memory


def test_concurrent_puts_and_gets(be: Backend) -> None:
    payloads = {f"job/3/rank{i}/shard": os.urandom(1000 + i) for i in range(16)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: be.put_bytes(*kv), payloads.items()))
        got = dict(zip(payloads, pool.map(be.get_bytes, payloads)))
    assert got == payloads


# --- listing, deleting, existence --------------------------------------------------------------


def test_list_is_recursive_sorted_and_prefix_based(be: Backend, backend_target) -> None:
    keys = ["job/1/a", "job/1/sub/b", "job/10/a", "job/2/x", "other"]
    for k in reversed(keys):
        be.put_bytes(k, b"x")
    assert be.list() == keys
    assert be.list("job/1/") == ["job/1/a", "job/1/sub/b"]
    assert be.list("job/1") == ["job/1/a", "job/1/sub/b", "job/10/a"]
    assert be.list("job/1/sub/b") == ["job/1/sub/b"]
    assert be.list("nothing/") == []
    with _open(backend_target.url + "-other") as other:
        assert other.list() == []  # keys are relative to the root prefix; roots do not overlap
        other.put_bytes("job/1/a", b"y")
    assert be.get_bytes("job/1/a") == b"x"


def test_delete_and_exists(be: Backend) -> None:
    be.put_bytes("job/5/rank0/a", b"1")
    be.put_bytes("job/5/rank0/b", b"2")
    be.put_bytes("job/5/rank1/a", b"3")
    assert be.exists("job/5/rank0/a")
    assert not be.exists("job/5/rank0")  # a "directory" is not an object
    be.delete(["job/5/rank0/a", "job/5/rank0/b", "job/5/never-existed"])
    be.delete([])
    assert not be.exists("job/5/rank0/a")
    assert be.list() == ["job/5/rank1/a"]


def test_missing_key_is_not_found(be: Backend, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="nope"):
        be.get_bytes("job/1/nope")
    dst = tmp_path / "keep"
    dst.write_bytes(b"old")
    with pytest.raises(NotFoundError):
        be.get_file("job/1/nope", dst)
    assert dst.read_bytes() == b"old"  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]
    assert not be.exists("job/1/nope")


@pytest.mark.parametrize("key", ["", "/abs", "../x", "a/../b", "a//b", "a/./b", "a/", "a\\b"])
def test_invalid_keys_are_refused(be: Backend, key: str) -> None:
    for call in (lambda: be.put_bytes(key, b"x"), lambda: be.get_bytes(key), lambda: be.delete(["ok", key])):
        with pytest.raises(InvalidArgumentError, match="key"):
            call()


def test_local_file_errors_are_os_errors(be: Backend, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        be.put_file("k", tmp_path / "does-not-exist")
    assert not be.exists("k")


# --- errors, retries, outages ------------------------------------------------------------------


@pytest.mark.parametrize("backend_target", ["s3", "gs"], indirect=True)
def test_missing_bucket_is_not_retryable(backend_target) -> None:
    url = f"{backend_target.kind}://no-such-bucket-{os.getpid()}/p"
    with open_backend(url) as backend:
        with pytest.raises(BackendError) as exc:
            backend.put_bytes("k", b"x")
    assert exc.value.retryable is False


@pytest.mark.parametrize("backend_target", ["s3", "gs"], indirect=True)
def test_server_outage_is_retryable_and_recovers(backend_target) -> None:
    server = backend_target.server
    with open_backend(backend_target.url, **_FAST[backend_target.kind]) as backend:
        backend.put_bytes("before", b"1")
        server.stop()
        try:
            for call in (lambda: backend.put_bytes("during", b"2"), lambda: backend.get_bytes("before"),
                         backend.list, lambda: backend.exists("before")):
                with pytest.raises(BackendError) as exc:
                    call()
                assert exc.value.retryable, exc.value
            # The retry helper rides out the outage: the server comes back after ~1 s. (exists()
            # because a restarted moto briefly answers before its buckets are recreated.)
            timer = threading.Timer(1.0, server.start)
            timer.start()
            policy = RetryPolicy(initial_delay=0.2, max_delay=0.5, deadline=30.0)
            survived = call_with_retry(lambda: backend.exists("before"), policy)
            timer.join()
        finally:
            server.start()
        # fake-gcs-server persists to disk; moto loses everything (the fixture recreates the bucket).
        assert survived is (backend_target.kind == "gs")
        backend.put_bytes("after", b"3")
        assert backend.get_bytes("after") == b"3"


def test_bad_urls_name_the_persistent_field() -> None:
    for url in ["", "ftp://host/x", "s3://", "s3:///prefix", "gs://b/../x", "s3://b/p?x=1", "file://relative/dir",
                "file:///", "s3://user:secret@bucket/p", "/plain/path"]:
        with pytest.raises(ConfigError, match=r"^persistent: "):
            open_backend(url)


def test_url_forms(tmp_path: Path) -> None:
    with open_backend(tmp_path.as_uri() + "/") as fb:
        fb.put_bytes("x", b"1")
    assert (tmp_path / "x").read_bytes() == b"1"


@pytest.mark.parametrize(("scheme", "module", "extra"), [("s3", "boto3", "tierckpt[s3]"),
                                                         ("gs", "google.cloud.storage", "tierckpt[gcs]")])
def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch, scheme: str, module: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` raise ImportError
    with pytest.raises(MissingExtraError, match=re.escape(f"pip install '{extra}'")):
        open_backend(f"{scheme}://bucket/prefix")


def test_s3_exposes_its_transfer_config(moto_server, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in moto_server.env.items():
        monkeypatch.setenv(k, v)
    with open_backend("s3://bucket/p") as backend:
        cfg = backend.transfer_config  # type: ignore[attr-defined]
        assert cfg.multipart_threshold == cfg.multipart_chunksize == 64 * MiB
        assert cfg.max_request_concurrency == 16


# --- file backend specifics --------------------------------------------------------------------


def test_file_backend_leaves_no_temporaries_and_prunes_dirs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with open_backend(root.as_uri()) as fb:
        fb.put_bytes("job/1/rank0/a", b"1")
        (root / "job" / "1" / "rank0" / "b.tierckpt-tmp-dead").write_bytes(b"partial")  # a crashed writer
        assert fb.list() == ["job/1/rank0/a"]
        (root / "job" / "1" / "rank0" / "b.tierckpt-tmp-dead").unlink()
        fb.delete(["job/1/rank0/a"])
    assert list(root.iterdir()) == []  # empty directories are pruned up to the root


# --- retry helper ------------------------------------------------------------------------------


class _Flaky:
    def __init__(self, errors: list[BaseException], result: str = "ok") -> None:
        self.errors, self.result, self.calls = list(errors), result, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.result


def _transient() -> BackendError:
    return BackendError("503 SlowDown", retryable=True)


def test_retry_retries_retryable_errors_with_growing_delays() -> None:
    fn, sleeps, seen = _Flaky([_transient() for _ in range(5)]), list[float](), list[tuple[int, float]]()
    policy = RetryPolicy(initial_delay=0.1, max_delay=0.5, multiplier=2.0, jitter=False)
    assert call_with_retry(fn, policy, on_retry=lambda a, e, d: seen.append((a, d)), sleep=sleeps.append) == "ok"
    assert fn.calls == 6
    assert sleeps == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert [a for a, _ in seen] == [1, 2, 3, 4, 5]


def test_retry_full_jitter_stays_within_the_bound() -> None:
    policy = RetryPolicy(initial_delay=1.0, max_delay=8.0)
    for attempt in range(1, 8):
        delays = [policy.delay(attempt) for _ in range(50)]
        assert all(0 <= d <= min(8.0, 2 ** (attempt - 1)) for d in delays)
        assert len(set(delays)) > 1


def test_retry_gives_up_at_once_on_non_retryable_errors() -> None:
    for err in (BackendError("403 AccessDenied", retryable=False), NotFoundError("k"), ValueError("bug")):
        fn, sleeps = _Flaky([err]), list[float]()
        with pytest.raises(type(err)):
            call_with_retry(fn, RetryPolicy(), sleep=sleeps.append)
        assert fn.calls == 1 and sleeps == []


def test_retry_respects_max_attempts_and_deadline() -> None:
    fn, sleeps = _Flaky([_transient() for _ in range(10)]), list[float]()
    with pytest.raises(BackendError, match="SlowDown"):
        call_with_retry(fn, RetryPolicy(max_attempts=3, jitter=False), sleep=sleeps.append)
    assert fn.calls == 3 and len(sleeps) == 2
    fn = _Flaky([_transient() for _ in range(10)])
    with pytest.raises(BackendError):  # the first delay would already end past a zero deadline
        call_with_retry(fn, RetryPolicy(deadline=0.0, jitter=False), sleep=lambda d: None)
    assert fn.calls == 1


def test_retry_policy_validates() -> None:
    for kwargs in ({"initial_delay": -1}, {"initial_delay": 5, "max_delay": 1}, {"multiplier": 0.5},
                   {"max_attempts": -1}, {"deadline": -1.0}):
        with pytest.raises(ValueError):
            RetryPolicy(**kwargs)




def test_file_backend_never_follows_a_symlink_below_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    with open_backend(root.as_uri()) as fb:
        fb.put_bytes("job/1/a", b"1")
        (root / "evil").symlink_to(outside)                     # a directory link
        (root / "job" / "1" / "link").symlink_to(outside / "secret")  # a file link
        for key in ("evil/secret", "job/1/link"):
            with pytest.raises(BackendError) as e:
                fb.get_bytes(key)
            assert not e.value.retryable
            assert not fb.exists(key)
        with pytest.raises(BackendError):
            fb.put_bytes("evil/new", b"x")                      # never written through the link
        fb.put_bytes("job/1/link", b"replaced")                 # the link is replaced, not followed
        fb.delete(["evil/secret"])
        assert fb.list() == ["job/1/a", "job/1/link"]
    assert (outside / "secret").read_bytes() == b"secret" and sorted(os.listdir(outside)) == ["secret"]
    assert (root / "job" / "1" / "link").read_bytes() == b"replaced"
    mode = os.stat(root / "job" / "1" / "a").st_mode & 0o777
    assert mode == 0o640 and os.stat(root / "job").st_mode & 0o777 == 0o750


def test_file_backend_put_file_refuses_a_symlinked_source(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"s")
    (tmp_path / "src").symlink_to(tmp_path / "secret")
    with open_backend((tmp_path / "root").as_uri()) as fb:
        with pytest.raises(OSError):
            fb.put_file("k", tmp_path / "src")
        assert fb.list() == []


def _small_parts(kind: str) -> dict[str, Any]:
    """Options that make a few MiB go in several parts (multipart / resumable chunks)."""
    if kind == "s3":
        from boto3.s3.transfer import TransferConfig

        return {"transfer_config": TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)}
    if kind == "gs":
        return {"chunk_size": 256 << 10}
    return {}


@pytest.mark.parametrize("corrupt", [False, True], ids=["verified", "mismatch"])
def test_put_stream_publishes_only_verified_bytes(backend_target, tmp_path: Path, corrupt: bool) -> None:
    """put_stream from the drain's verifying reader: in several parts; a checksum mismatch found
    on the last read aborts the put and nothing is visible at the key."""
    from tierckpt.common import checksum
    from tierckpt.errors import DataLossError
    from tierckptd.persistent.verify import VerifyingReader

    size = 11 * MiB + 5
    data = os.urandom(size)
    src = tmp_path / "shard"
    src.write_bytes(data)
    expected = checksum.digest(data if not corrupt else data[:-1] + bytes([data[-1] ^ 1]))
    be = _open(backend_target.url) if backend_target.kind == "memory" else \
        open_backend(backend_target.url, **_small_parts(backend_target.kind))
    fd = os.open(src, os.O_RDONLY)
    try:
        reader = VerifyingReader(fd, size, expected, "shard")
        if corrupt:
            with pytest.raises(DataLossError):
                be.put_stream("job/1/shard", reader, size)  # type: ignore[arg-type]
            assert not be.exists("job/1/shard") and be.list("job/") == []
        else:
            be.put_stream("job/1/shard", reader, size)  # type: ignore[arg-type]
            reader.check()
            assert be.get_bytes("job/1/shard") == data
            be.delete(["job/1/shard"])
    finally:
        os.close(fd)
        be.close()
