"""Helpers of the claim tests: deterministic incompressible payloads, the keys of a moto bucket
(listed with boto3's paginator, so more than one page of 1,000), the health service and metrics
of a daemon, files of the local tier, and a TCP proxy that can cut a daemon off its object store
and shows the requests it forwarded (moto, unlike S3, takes more than 1,000 keys per delete)."""

from __future__ import annotations

import os
import re
import socket
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def noise(size: int, *seed: int) -> bytes:
    """``size`` incompressible bytes, the same for the same seed (no two chunks alike)."""
    return np.random.default_rng(list(seed)).bytes(size)


def bucket_keys(server, bucket: str, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` of a moto bucket, through every page of ListObjectsV2."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def health(address: str, service: str) -> int:
    """The status the daemon's grpc.health.v1 service answers for ``service``."""
    with grpc.insecure_channel(address) as ch:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=10).status


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def rank_dir(local_dir: Path, job: str, step: int, rank: int) -> Path:
    return Path(local_dir) / "jobs" / job / f"{step:020d}" / f"rank-{rank:07d}"


def flip_bit(path: Path, offset: int = 0) -> None:
    """Flip one bit of a file in place (same inode, same size)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x01]), offset)
    finally:
        os.close(fd)


class Proxy:
    """A TCP proxy on loopback: ``cut()`` resets every connection and refuses new ones,
    ``heal()`` forwards again; ``requests`` keeps what each client sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = True
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self.requests: list[bytearray] = []  # what each client connection sent, in order
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
            if not self.up:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.close()
                continue
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            sent = bytearray()
            with self._lock:
                self._conns += [c, u]
                self.requests.append(sent)
            threading.Thread(target=self._pipe, args=(c, u, sent), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, None), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, record: bytearray | None) -> None:
        try:
            while data := a.recv(1 << 16):
                if not self.up:
                    break
                if record is not None:
                    record += data
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
        self.up = False
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def heal(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self._lsock.close()


_REQUEST_LINE = re.compile(rb"(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP/1\.1\r\n")


def delete_batches(proxy: Proxy) -> list[int]:
    """The number of keys in each S3 DeleteObjects request that went through ``proxy`` (the
    request line ``POST /...?delete``; its XML body names each key in a ``<Key>`` element)."""
    batches = []
    with proxy._lock:
        streams = [bytes(r) for r in proxy.requests]
    for stream in streams:
        lines = list(_REQUEST_LINE.finditer(stream))
        for m, nxt in zip(lines, [*lines[1:], None]):
            if m.group(1) == b"POST" and b"?delete" in m.group(2):
                batches.append(stream[m.end():nxt.start() if nxt else len(stream)].count(b"<Key>"))
    return batches
