"""Helpers of the fault matrix: deterministic payloads, saving and byte-for-byte checking,
bit flips in stored files, the objects a rank's manifest names in a ``file://`` persistent tier
(chunks of the content layout, or per-shard data objects), raw gRPC stubs, and a TCP proxy that
can be cut or hung."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path
from typing import Any

import grpc
import tierckpt
from tierckpt.errors import TierckptError
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc
from tierckptd.local.manifest import Manifest
from tierckptd.persistent.layout import chunk_keys, data_key, is_content, manifest_rank_prefix

from .matrix import Matrix


def payload(job: str, step: int, rank: int, name: str, size: int) -> bytes:
    """Bytes that name their own job/step/rank/shard (a mix-up or a corrupt byte shows)."""
    seed = hashlib.sha256(f"{job}/{step}/{rank}/{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def shards_for(job: str, step: int, rank: int, sizes: dict[str, int]) -> dict[str, bytes]:
    return {name: payload(job, step, rank, name, n) for name, n in sizes.items()}


def save(c: tierckpt.Client, job: str, step: int, rank: int, sizes: dict[str, int], world: int = 1,
         **kw: Any) -> Any:
    """Save and wait for the local commit; returns the future (for ``wait``)."""
    fut = c.save(job, step, rank, world, shards_for(job, step, rank, sizes), **kw)
    fut.result(60)
    return fut


class Checker:
    """Restores committed steps and counts what the fault matrix reports."""

    def __init__(self, matrix: Matrix) -> None:
        self.matrix = matrix

    def restore_ok(self, c: tierckpt.Client, job: str, step: int, rank: int, sizes: dict[str, int]) -> bool:
        """Restore one committed rank: True when every byte matches; a wrong byte is counted."""
        self.matrix.record(committed=1)
        try:
            ck = c.restore(job, rank=rank, step=step)
        except TierckptError as e:
            self.matrix.record(lost=1, typed=1)
            print(f"lost {job} step {step} rank {rank}: {e!r}")
            return False
        except Exception as e:  # an untyped error is a finding of its own
            self.matrix.record(lost=1, untyped=1)
            print(f"untyped error restoring {job} step {step} rank {rank}: {e!r}")
            return False
        want = shards_for(job, step, rank, sizes)
        got = {n: bytes(ck.shards[n]) for n in ck.shards}
        if ck.step != step or got != want:
            self.matrix.record(corrupt_returned=1)
            return False
        return True

    def expect_error(self, fn: Any, *types: type[BaseException]) -> BaseException:
        """Call ``fn``; it must raise a typed tierckpt error (of ``types`` when given)."""
        try:
            fn()
        except TierckptError as e:
            if type(e) is TierckptError:  # the class of UNKNOWN: never what a client call raises (issue 25)
                self.matrix.record(untyped=1)
                raise AssertionError(f"bare TierckptError {e!r}") from e
            self.matrix.record(typed=1)
            if types and not isinstance(e, types):
                raise AssertionError(f"expected {types}, got {e!r}") from e
            return e
        except Exception as e:
            self.matrix.record(untyped=1)
            raise AssertionError(f"untyped error {e!r}") from e
        raise AssertionError("no error")


def rank_dir(local_dir: Path, job: str, step: int, rank: int) -> Path:
    return Path(local_dir) / "jobs" / job / f"{step:020d}" / f"rank-{rank:07d}"


def data_files(local_dir: Path, job: str, step: int, rank: int) -> list[Path]:
    return sorted(p for p in rank_dir(local_dir, job, step, rank).iterdir() if p.name != "manifest.json")


def flip_bit(path: Path, offset: int = 0) -> None:
    """Flip one bit in place (same inode, same size, same mtime is not kept)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x01]), offset)
    finally:
        os.close(fd)


def stored_manifest(store: Path, job: str, step: int, rank: int) -> tuple[Path, Manifest]:
    """The manifest file of a rank in a ``file://`` persistent tier at ``store``, parsed."""
    prefix = manifest_rank_prefix(job, step, rank)
    head, tail = prefix.rsplit("/", 1)
    path = next(p for p in (Path(store) / head).iterdir() if p.name.startswith(tail))
    return path, Manifest.from_json(path.read_bytes())


def stored_objects(store: Path, job: str, step: int, rank: int, shard: str | None = None) -> list[Path]:
    """The objects a rank's stored manifest names, in shard order (of ``shard`` only when given):
    its chunks (content layout) or its data objects (per-shard layout)."""
    _, man = stored_manifest(store, job, step, rank)
    keys = [k for s in man.shards if shard in (None, s.name)
            for k in (chunk_keys(job, s) if is_content(s) else [data_key(job, step, rank, s)])]
    return [Path(store) / k for k in keys]


def stored_shards(store: Path, job: str, step: int, rank: int) -> dict[str, bytes]:
    """The bytes of every shard of a rank as the ``file://`` persistent tier holds them (decoded)."""
    from tierckptd.persistent.compress import decode

    _, man = stored_manifest(store, job, step, rank)
    out = {}
    for s in man.shards:
        paths = stored_objects(store, job, step, rank, s.name)
        if is_content(s):
            out[s.name] = b"".join(decode(s.codec, p.read_bytes(), n) for p, (_, n, _) in zip(paths, s.chunks))
        else:
            out[s.name] = paths[0].read_bytes()
    return out


def stored_files(store: Path, where: str) -> list[Path]:
    """Every finished object of the store whose path contains ``where`` (``"/content/"``, ...)."""
    return sorted(p for p in Path(store).rglob("*") if p.is_file() and where in str(p) and "tierckpt-tmp" not in p.name)


def stubs(target: str) -> tuple[grpc.Channel, pb_grpc.TierckptStub, ppb_grpc.PeerStub]:
    ch = grpc.insecure_channel(target)
    return ch, pb_grpc.TierckptStub(ch), ppb_grpc.PeerStub(ch)


class Proxy:
    """A TCP proxy on loopback: ``cut()`` resets every connection and refuses new ones,
    ``hang()`` accepts but forwards nothing, ``heal()`` forwards again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "up"
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._lsock.accept()
            except OSError:
                return
            if self.mode == "cut":
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.close()
                continue
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                while self.mode == "hang":
                    threading.Event().wait(0.05)
                if self.mode == "cut":
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.mode = "cut"
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def hang(self) -> None:
        self.mode = "hang"

    def heal(self) -> None:
        self.mode = "up"

    def close(self) -> None:
        self.cut()
        self._lsock.close()
