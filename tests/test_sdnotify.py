"""sd_notify client against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import uuid
from collections.abc import Iterator

import pytest
from tierckptd.sdnotify import Notifier, watchdog_loop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sd_notify is Linux-only")


class FakeSystemd:
    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value
        sock.settimeout(5)

    def recv(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))


@pytest.fixture(params=["path", "abstract"])
def systemd(request: pytest.FixtureRequest, tmp_path) -> Iterator[FakeSystemd]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = str(tmp_path / "notify.sock")
        sock.bind(path)
        env_value = path
    else:
        name = "tierckpt-test-%s" % uuid.uuid4().hex
        sock.bind("\0" + name)
        env_value = "@" + name
    try:
        yield FakeSystemd(sock, env_value)
    finally:
        sock.close()


def test_messages_reach_systemd(systemd: FakeSystemd) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": systemd.env_value})
    assert n.enabled and n.watchdog_interval() is None
    assert n.ready()
    assert systemd.recv() == {"READY": "1"}
    assert n.status("scanning\nREADY=1")  # a newline must not start a second assignment
    assert systemd.recv() == {"STATUS": "scanning READY=1"}
    assert n.watchdog()
    assert systemd.recv() == {"WATCHDOG": "1"}
    assert n.stopping("draining")
    assert systemd.recv() == {"STOPPING": "1", "STATUS": "draining"}
    assert n.extend_timeout(90)
    assert systemd.recv() == {"EXTEND_TIMEOUT_USEC": "90000000"}
    n.close()


def test_watchdog_interval_from_env() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env(env).watchdog_interval() == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval() is None
    assert Notifier.from_env({**env, "WATCHDOG_USEC": "bogus"}).watchdog_interval() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "30000000"}).watchdog_interval() is None


def test_noop_without_notify_socket() -> None:
    for env in ({}, {"NOTIFY_SOCKET": ""}):
        n = Notifier.from_env(env)
        assert not n.enabled
        assert not any([n.ready(), n.status("x"), n.watchdog(), n.stopping()])
    asyncio.run(asyncio.wait_for(watchdog_loop(Notifier.from_env({}), lambda: "x"), 1))  # returns at once


def test_send_error_is_swallowed(tmp_path) -> None:
    assert Notifier(str(tmp_path / "missing.sock")).ready() is False


def test_watchdog_loop_pings_and_refreshes_status(systemd: FakeSystemd) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": systemd.env_value, "WATCHDOG_USEC": "20000"})  # every 10 ms
    calls = iter(range(1000))

    def status() -> str:
        i = next(calls)
        if i == 1:
            raise RuntimeError("status broke")  # logged; pings continue
        return "tick %d" % i

    msgs: list[dict[str, str]] = []

    async def run() -> None:
        task = asyncio.create_task(watchdog_loop(n, status))
        loop = asyncio.get_running_loop()
        systemd.sock.settimeout(60)
        for _ in range(3):  # the first three pings, however long a loaded machine takes
            msgs.append(await loop.run_in_executor(None, systemd.recv))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert len(msgs) == 3
    assert all(m["WATCHDOG"] == "1" for m in msgs)
    assert msgs[0]["STATUS"] == "tick 0" and "STATUS" not in msgs[1] and msgs[2]["STATUS"] == "tick 2"
