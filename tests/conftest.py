import shutil

import pytest

from .harness import Daemon, scratch_dir

pytest_plugins = ["tests.servers"]


@pytest.fixture
def scratch():
    d = scratch_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_factory(scratch):
    """Start daemons: ``daemon_factory(node_id="n0", args=(...))``; all are killed at teardown."""
    started: list[Daemon] = []

    def make(node_id: str = "node0", *, args=(), port: int = 0, env=None, start: bool = True) -> Daemon:
        d = Daemon(scratch, node_id, port=port, args=tuple(args), env=env)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        d.kill()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()
