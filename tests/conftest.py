import shutil

import pytest

from .harness import Daemon, scratch_dir

pytest_plugins = ["tests.servers"]


def pytest_sessionstart(session):
    """Declared test dependencies are required (tests/deps.py): a broken install fails the run
    here, naming what is missing, instead of skipping the tests that need it."""
    from .deps import declared, unmet

    missing = unmet(declared())
    if missing:
        raise pytest.UsageError("declared test dependencies missing or too old: " + ", ".join(missing)
                                + " (make venv installs them: pip install -r requirements-test.txt -e "
                                "'.[daemon,s3,gcs,torch,dev]')")


@pytest.fixture(autouse=True)
def _no_warm_pool_in_process():
    """In-process stores do not warm pool files in the background (their tests check the bytes
    and pool contents exactly); tests/local/test_warm.py turns it on where it is the subject.
    Daemon processes keep the default."""
    from tierckptd.knobs import KNOBS

    with KNOBS.overridden(warm_pool=0):
        yield


@pytest.fixture
def scratch():
    d = scratch_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def _dump_logs(daemons: list[Daemon], lines: int = 60) -> None:
    """A failed test prints the tail of each daemon's log (CI keeps nothing else of them)."""
    for d in daemons:
        try:
            tail = d.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        print(f"----- log of daemon {d.node_id} (last {len(tail)} lines) -----")
        print("\n".join(tail))


@pytest.fixture
def daemon_factory(scratch, request):
    """Start daemons: ``daemon_factory(node_id="n0", args=(...))``; all are killed at teardown
    (a failed test prints the tail of their logs)."""
    started: list[Daemon] = []

    def make(node_id: str = "node0", *, args=(), port: int = 0, env=None, start: bool = True) -> Daemon:
        d = Daemon(scratch, node_id, port=port, args=tuple(args), env=env)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        d.kill()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        _dump_logs(started)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()
