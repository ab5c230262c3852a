"""The `tierckpt` CLI (and `tierckptd --help/--version`): the error contract case by case, --json on
every read command, help, completion and `plan`. Commands run as real subprocesses (or through
`cli.main` with captured streams) against a real daemon."""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tierckpt import cli
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckptd.testing import Daemon, free_port, scratch_dir

from .tty import run_on_tty

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENV = {k: v for k, v in os.environ.items() if k != "TIERCKPT_ADDRESS"}


def run(*argv: str, env: dict | None = None, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a subprocess with piped stdout and stderr."""
    return subprocess.run([sys.executable, "-m", "tierckpt.cli", *argv], capture_output=True, text=True,
                          env=env or ENV, timeout=timeout, **kw)


def call(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(list(argv), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def assert_json_style(doc: object, path: str = "$") -> None:
    """snake_case keys; numbers are numbers, never strings of digits."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            assert re.fullmatch(r"[a-z][a-z0-9_]*", k), f"{path}: key {k!r} is not snake_case"
            assert_json_style(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            assert_json_style(v, f"{path}[{i}]")
    elif isinstance(doc, str):
        assert not re.fullmatch(r"-?\d+", doc), f"{path}: integer as a string {doc!r}"


# --- a daemon with one checkpoint, shared by the module ------------------------------------------

ARR = np.arange(1000, dtype=np.float32)


@pytest.fixture(scope="module")
def daemon():
    root = scratch_dir()
    d = Daemon(root, "node0", args=("--metrics-port", str(free_port()))).start()
    try:
        with d.client() as c:
            c.save("job", 7, 0, 2, {"w": ARR, "b": b"bias"}, metadata={"epoch": 1}).result(30)
            c.save("job", 7, 1, 2, {"w": ARR + 1}).result(30)
            c.save("job", 9, 0, 2, {"w": ARR}).result(30)  # rank 1 of step 9 never saved
        yield d
    finally:
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def metrics_port(daemon) -> int:
    return int(daemon.args[daemon.args.index("--metrics-port") + 1])


# --- exit 2: bad input, one line naming the argument, nothing asked --------------------------------

BAD_INPUT = [
    (["--timeout", "0", "status"], "--timeout"),
    (["--timeout", "-1", "status"], "--timeout"),
    (["--timeout", "nan", "status"], "--timeout"),
    (["status", "--timeout", "soon"], "--timeout"),
    (["--address", "nowhere", "status"], "--address"),
    (["--address", "host:99999", "status"], "--address"),
    (["latest", "../etc"], "JOB"),
    (["ls", "a/b"], "JOB"),
    (["restore", "job", "--out", "x"], "--rank"),
    (["restore", "job", "--rank", "0"], "--out"),
    (["restore", "job", "--rank", "-1", "--out", "x"], "--rank"),
    (["restore", "job", "--rank", "one", "--out", "x"], "--rank"),
    (["restore", "job", "--rank", "0", "--step", "-3", "--out", "x"], "--step"),
    (["restore", "job", "--rank", "0", "--out", "/proc/version"], "--out"),
    (["restore", "job", "--rank", "0", "--out", "/proc/version/sub"], "--out"),
    (["frobnicate"], "COMMAND"),
    (["ls"], "JOB"),
    (["completion", "fish"], "SHELL"),
    (["policy", "bad/job"], "JOB"),
    (["policy", "job", "--keep-local", "0"], "--keep-local"),
    (["policy", "job", "--persist-every", "-1"], "--persist-every"),
    (["rm", "job"], "--step"),
    (["rm", "job", "--step", "1", "--tier", "disk"], "--tier"),
    (["verify", "job", "--step", "x"], "--step"),
    (["persist", "job"], "--step"),
    (["plan", "--step-time", "1", "--persistent-save", "30"], "--mtbi"),
    (["plan", "--mtbi", "4x", "--step-time", "1", "--persistent-save", "30"], "--mtbi"),
    (["plan", "--mtbi", "4h", "--step-time", "1"], "--persistent-save"),
    (["plan", "--mtbi", "4h", "--step-time", "1", "--persistent-save", "30", "--crash-fraction", "2"],
     "--crash-fraction"),
]


@pytest.mark.parametrize("argv,name", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_naming_the_argument(argv, name):
    # The address is unreachable on purpose: bad input is found before the daemon is asked.
    rc, out, err = call("--address", "unix:///nonexistent/d.sock", *argv) if "--address" not in argv else call(*argv)
    assert rc == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierckpt: error: ") and name in lines[0], err


def test_bad_address_in_the_environment_names_the_variable():
    p = run("status", env=dict(ENV, TIERCKPT_ADDRESS="not an address"))
    assert p.returncode == 2 and "$TIERCKPT_ADDRESS" in p.stderr and p.stdout == ""


# --- exit 3: unreachable or not answering, naming the address and what to check -------------------

def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.fixture()
def black_hole():
    """A TCP listener that accepts connections (backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


READS = [["status"], ["ls", "job"], ["latest", "job"], ["status", "--json"]]


@pytest.mark.parametrize("argv", READS, ids=" ".join)
def test_missing_socket_exits_3_naming_address_and_what_to_check(argv, tmp_path):
    address = f"unix://{tmp_path}/d.sock"
    p = run("--address", address, "--timeout", "5", *argv)
    assert p.returncode == 3 and p.stdout == ""
    error, hint = p.stderr.strip().splitlines()
    assert error.startswith("tierckpt: error: ") and address in error and "no socket at" in error
    assert "(from --address)" in error
    assert hint.startswith("tierckpt: hint: ") and "tierckptd is running" in hint and "TIERCKPT_ADDRESS" in hint


def test_socket_nobody_serves_and_environment_source(tmp_path):
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # a socket file left behind: bound, never listening
        p = run("latest", "job", "--timeout", "5", env=dict(ENV, TIERCKPT_ADDRESS=f"unix://{path}"))
    assert p.returncode == 3
    assert f"unix://{path} (from $TIERCKPT_ADDRESS)" in p.stderr and "nothing accepts connections" in p.stderr


def test_refused_tcp_port_exits_3():
    address = f"127.0.0.1:{_refused_port()}"
    for argv in READS:
        p = run("--address", address, "--timeout", "5", *argv)
        assert p.returncode == 3, p.stderr
        assert address in p.stderr and "connection refused" in p.stderr and "--listen" in p.stderr


@pytest.mark.parametrize("argv", [*READS, ["restore", "job", "--rank", "0"]], ids=" ".join)
def test_listener_that_never_answers_exits_3_within_the_timeout(argv, black_hole, tmp_path):
    out = tmp_path / "restored"
    extra = ["--out", str(out)] if argv[0] == "restore" else []
    p = run("--address", black_hole, "--timeout", "1", *argv, *extra, timeout=30)
    assert p.returncode == 3, p.stderr
    assert f"{black_hole} (from --address) did not answer within 1 s (--timeout)" in p.stderr
    assert "tierckpt: hint:" in p.stderr and p.stdout == ""
    assert not out.exists()


def test_unreachable_restore_creates_nothing(tmp_path):
    out = tmp_path / "a" / "b"
    p = run("--address", f"unix://{tmp_path}/none.sock", "restore", "job", "--rank", "0", "--out", str(out))
    assert p.returncode == 3 and not (tmp_path / "a").exists()


# --- against a real daemon -----------------------------------------------------------------------

def test_status_text_says_what_is_not_configured(daemon):
    p = run("--address", daemon.address, "status")
    assert p.returncode == 0, p.stderr
    assert "node: node0" in p.stdout
    assert "peer tier: not configured" in p.stdout and "replicas=" not in p.stdout
    assert "persistent tier: not configured" in p.stdout
    assert "job job: 2 steps, latest complete 7" in p.stdout


def test_status_text_with_peers():
    st = pb.StatusResponse(node_id="n0", version="x", replicas=1, peers=[
        pb.PeerStatus(node_id="n1", address="10.0.0.2:7070", up=True),
        pb.PeerStatus(node_id="n2", address="10.0.0.3:7070", up=False, last_error="refused")])

    class Fake:
        address, client = "unix:///x", type("C", (), {"status": staticmethod(lambda: st)})()

        def call(self, fn, *a, **kw):
            return fn(*a, **kw)

    out = io.StringIO()
    from tierckpt.cli._commands import cmd_status

    cmd_status(type("A", (), {"json": False})(), Fake(), out)
    text = out.getvalue()
    assert "peer tier: 1 copy of every rank; 1 of 2 peers up" in text
    assert "n2" in text and "DOWN (refused)" in text


def test_status_json(daemon):
    p = run("--address", daemon.address, "status", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert_json_style(doc)
    assert doc["node_id"] == "node0" and isinstance(doc["local_tier"]["capacity_bytes"], int)
    assert doc["peer_tier"] == {"configured": False, "replicas": 1, "peers": []}
    assert doc["persistent_tier"]["configured"] is False
    assert doc["jobs"] == [{"job": "job", "steps": 2, "latest": 7, "bytes": doc["jobs"][0]["bytes"]}]
    assert isinstance(doc["jobs"][0]["bytes"], int) and doc["jobs"][0]["bytes"] > 0


def test_ls_text_and_per_rank_placement(daemon):
    p = run("--address", daemon.address, "ls", "job")
    assert p.returncode == 0, p.stderr
    header, row7, row9, note = p.stdout.splitlines()
    assert "COMPLETE IN" in header and "TIERS" not in header
    assert row7.split()[:4] == ["7", "2/2", "yes", "local"]
    assert row9.split()[:4] == ["9", "1/2", "no", "-"]
    assert "COMPLETE IN: tiers that hold every rank" in note
    p = run("--address", daemon.address, "ls", "job", "--ranks")
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 1 + 3 + 3 + 1
    assert lines[2].split() == ["rank", "0", "local", "3.9", "KiB", "node0"]
    assert lines[3].split() == ["rank", "1", "local", "3.9", "KiB", "node0"]
    assert lines[6].split() == ["rank", "1", "missing", "-", "-", "-"]


def test_ls_json(daemon):
    p = run("--address", daemon.address, "ls", "job", "--json")
    doc = json.loads(p.stdout)
    assert_json_style(doc)
    assert doc["job"] == "job" and [c["step"] for c in doc["checkpoints"]] == [7, 9]
    c7 = doc["checkpoints"][0]
    assert c7["complete"] is True and c7["complete_in"] == ["local"] and c7["world_size"] == 2
    assert c7["ranks"][0] == {"rank": 0, "tiers": ["local"], "nodes": ["node0"], "bytes": 4004}
    assert c7["bytes"] == 8004
    p = run("--address", daemon.address, "ls", "nothing", "--json")
    assert p.returncode == 4 and p.stdout == "" and "nothing" in p.stderr  # README: 4 = not found


def test_latest_text_json_and_not_found(daemon):
    assert run("--address", daemon.address, "latest", "job").stdout == "7\n"
    p = run("--address", daemon.address, "latest", "job", "--json")
    assert json.loads(p.stdout) == {"job": "job", "step": 7}
    p = run("--address", daemon.address, "latest", "nojob", "--json")
    assert p.returncode == 4 and p.stdout == ""
    assert p.stderr.strip() == "tierckpt: error: job 'nojob' has no complete checkpoint in any tier"


def test_restore_writes_files_and_a_summary(daemon, tmp_path):
    out = tmp_path / "r0"
    p = run("--address", daemon.address, "restore", "job", "--rank", "0", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"restored job step 7 rank 0 from the local tier into {out}")
    assert p.stderr == ""  # stderr is a pipe: no progress bar
    assert np.array_equal(np.fromfile(out / "w", dtype=np.float32), ARR)
    assert (out / "b").read_bytes() == b"bias"
    meta = json.loads((out / "checkpoint.json").read_text())
    assert meta["metadata"] == {"epoch": 1} and meta["shards"]["w"] == {"dtype": "<f4", "shape": [1000],
                                                                       "bytes": 4000}
    assert sorted(os.listdir(out)) == ["b", "checkpoint.json", "w"]


def test_restore_json(daemon, tmp_path):
    out = tmp_path / "r1"
    p = run("restore", "job", "--rank", "1", "--step", "7", "--out", str(out), "--json", "--address", daemon.address)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert_json_style(doc)
    assert (doc["job"], doc["step"], doc["rank"], doc["world_size"], doc["tier"]) == ("job", 7, 1, 2, "local")
    assert doc["out"] == str(out) and doc["bytes"] == 4000
    assert doc["shards"]["w"]["file"] == str(out / "w")


@pytest.mark.parametrize("argv", [["nojob", "--rank", "0"], ["job", "--rank", "0", "--step", "8"],
                                  ["job", "--rank", "1", "--step", "9"], ["job", "--rank", "5", "--step", "7"]],
                         ids=["no job", "no step", "rank not saved", "rank out of range"])
def test_restore_not_found_exits_4_and_creates_nothing(daemon, tmp_path, argv):
    out = tmp_path / "never"
    p = run("--address", daemon.address, "restore", *argv, "--out", str(out))
    assert p.returncode == 4, p.stderr  # README: 4 = not in any reachable tier (2 = the daemon was not asked)
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""
    assert not out.exists()


def test_progress_bar_only_on_a_terminal(daemon, tmp_path):
    p, drawn = run_on_tty([sys.executable, "-m", "tierckpt.cli", "--address", daemon.address, "restore", "job",
                            "--rank", "0", "--out", str(tmp_path / "t")], env=ENV)
    assert p.returncode == 0
    assert b"100.0%" in drawn and b"[####" in drawn
    p = subprocess.run([sys.executable, "-m", "tierckpt.cli", "--address", daemon.address, "restore", "job",
                        "--rank", "0", "--out", str(tmp_path / "q"), "--quiet"], capture_output=True, env=ENV,
                       timeout=60)
    assert p.returncode == 0 and p.stderr == b""


def test_closed_stdout_is_quiet(daemon):
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    assert cli.main(["--address", daemon.address, "ls", "job"], out=ClosedPipe(), err=err) == 1
    assert err.getvalue() == ""


_SMALL_FILES = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
                "sys.argv[0] = 'tierckpt'; runpy.run_module('tierckpt.cli', run_name='__main__')")


def _run_small_files(*argv: str) -> subprocess.CompletedProcess:
    """The CLI in a process whose files may not grow past 1000 bytes (EFBIG: Python ignores
    SIGXFSZ). The limit is set by the child's own interpreter, not by a ``preexec_fn``: that
    forks this process, which runs gRPC, and gRPC's fork handler restarts its poller in the
    child, whose epoll descriptor ``close_fds`` then closes: the child aborted before its exec
    now and then ("epoll_wait error: Bad file descriptor", grpc/grpc#43055)."""
    return subprocess.run([sys.executable, "-c", _SMALL_FILES, *argv], capture_output=True, text=True, env=ENV,
                          timeout=60)


def test_error_from_an_answering_daemon_is_exit_1(daemon, tmp_path):
    out = tmp_path / "ro"
    p = _run_small_files("--address", daemon.address, "restore", "job", "--rank", "0", "--out", str(out))
    # (the 4000-byte shard cannot be written)
    assert p.returncode == 1 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert str(out / "w") in p.stderr
    assert os.listdir(tmp_path) == []  # nothing left behind, not even the temporary directory
    out.mkdir()  # an existing empty directory is written in place, and emptied again on failure
    p = _run_small_files("--address", daemon.address, "restore", "job", "--rank", "0", "--out", str(out))
    assert p.returncode == 1 and os.listdir(out) == [], p.stderr


# --- --version, help, completion ------------------------------------------------------------------

def test_version_of_both_binaries():
    import tierckpt
    import tierckptd

    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"tierckpt {tierckpt.__version__}"
    p = subprocess.run([sys.executable, "-m", "tierckptd.main", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"tierckptd {tierckptd.__version__}"


def test_daemon_help_shows_octal_mode_and_metavars_by_kind():
    p = subprocess.run([sys.executable, "-m", "tierckptd.main", "--help"], capture_output=True, text=True,
                       timeout=60, env=dict(ENV, COLUMNS="200"))
    assert p.returncode == 0
    assert "(default: 0660)" in p.stdout and "432" not in p.stdout
    for flag in ("--keep-local N", "--local-capacity BYTES", "--socket PATH", "--listen HOST:PORT",
                 "--persistent URL", "--local-dir DIR", "--staging-timeout SECONDS", "--metrics-port PORT",
                 "--peers ID=HOST:PORT,...", "--tls-cert FILE.pem"):
        assert flag in p.stdout, flag
    assert "LOCAL" not in p.stdout and "CAPACITY" not in p.stdout


def _subparsers(parser):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_argument_has_help_and_every_command_an_example():
    import argparse

    parser = cli.build_parser()
    for name, sp in {"tierckpt": parser, **_subparsers(parser)}.items():
        for a in sp._actions:
            if isinstance(a, argparse._SubParsersAction):
                continue
            assert a.help and a.help != argparse.SUPPRESS, f"{name} {a.option_strings or a.dest}: no help"
            if a.option_strings and a.nargs != 0:
                assert a.metavar and a.metavar.upper() == a.metavar, f"{name} {a.option_strings}: metavar"
        if name != "tierckpt":
            assert "examples:\n  tierckpt " + name in (sp.epilog or ""), name
    p = run("restore", "--help")
    assert p.returncode == 0 and "--out DIR" in p.stdout and "examples:" in p.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_scripts(shell, tmp_path):
    p = run("completion", shell)
    assert p.returncode == 0, p.stderr
    for word in ("restore", "status", "latest", "--json", "--ranks", "--metrics-url"):
        assert word in p.stdout
    assert ("_shtab_tierckpt_restore___out_COMPGEN=_shtab_compgen_dirs" if shell == "bash" else
            ":DIR:_files -/") in p.stdout  # --out completes directories
    if shell == "bash" and shutil.which("bash"):
        script = tmp_path / "c.bash"
        script.write_text(p.stdout)
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_completion_without_shtab_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "shtab", None)
    rc, out, err = call("completion", "bash")
    assert rc == 1 and out == "" and "pip install shtab" in err


# --- plan -----------------------------------------------------------------------------------------

FULL = ("--mtbi 4h --crash-fraction 0.3 --node-fraction 0.6 --cluster-fraction 0.1 --step-time 2 "
        "--local-save 0.5 --local-restore 5 --peer-save 2 --peer-restore 30 --persistent-save 30 "
        "--persistent-restore 5m")


def plan(argv: str) -> tuple[int, str, str]:
    return call("plan", *argv.split())


def test_plan_json_matches_the_planner():
    from tierckpt import goodput as gp

    rc, out, err = plan(FULL + " --json")
    assert rc == 0, err
    doc = json.loads(out)
    assert_json_style(doc)
    costs = (gp.TierCost("local", 0.5, 5.0), gp.TierCost("peer", 2.0, 30.0), gp.TierCost("persistent", 30.0, 300.0))
    expected = gp.plan(costs, gp.FailureModel(4 * 3600.0, 0.3, 0.6, 0.1), 2.0)
    assert doc["inputs"]["mtbi_s"] == 4 * 3600 and doc["inputs"]["persistent_restore"] == 300.0
    assert doc["measured"] == [] and doc["defaulted"] == []
    assert doc["goodput"] == pytest.approx(expected.goodput)
    assert {t["name"]: t["interval_steps"] for t in doc["tiers"]} == expected.intervals_steps


def test_plan_table():
    rc, out, _ = plan(FULL)
    assert rc == 0
    for word in ("local", "peer", "persistent", "goodput", "baseline", "lost", "crash", "cluster"):
        assert word in out
    assert "*" not in out  # nothing defaulted


def test_plan_defaults_failure_mix_and_restore_times():
    rc, out, err = plan("--mtbi 4h --step-time 1 --local-save 0.1 --persistent-save 30 --json")
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["inputs"]["crash_fraction"], doc["inputs"]["node_fraction"], doc["inputs"]["cluster_fraction"]) \
        == (0.3, 0.6, 0.1)
    assert doc["inputs"]["local_restore"] == 0.1 and doc["inputs"]["persistent_restore"] == 30.0
    assert doc["defaulted"] == ["crash_fraction", "node_fraction", "cluster_fraction", "local_restore",
                                "persistent_restore"]
    assert [t["name"] for t in doc["tiers"]] == ["local", "persistent"]
    # One fraction given: the others share the rest in the default ratio; two given: the third is the rest.
    doc = json.loads(plan("--mtbi 4h --step-time 1 --persistent-save 30 --cluster-fraction 0.01 --json")[1])
    assert doc["inputs"]["crash_fraction"] == pytest.approx(0.33) and doc["inputs"]["node_fraction"] == \
        pytest.approx(0.66)
    doc = json.loads(plan("--mtbi 240m --crash-fraction 0.3 --node-fraction 0.6 --step-time 2000ms "
                          "--persistent-save 30 --persistent-restore 300 --json")[1])
    assert doc["inputs"]["cluster_fraction"] == pytest.approx(0.1) and doc["step_time_s"] == 2.0
    assert doc["goodput"] == pytest.approx(doc["baseline"]["goodput"])
    rc, out, _ = plan("--mtbi 4h --step-time 1 --local-save 0.1 --persistent-save 30")
    assert "default mix" in out and "30 s (*)" in out and "taken as the tier's save time" in out


@pytest.mark.parametrize("argv,flag", [
    (FULL.replace("--mtbi 4h", "--mtbi 0"), "--mtbi"),
    (FULL.replace("--step-time 2 ", ""), "--step-time"),
    (FULL.replace("--crash-fraction 0.3", "--crash-fraction nan"), "--crash-fraction"),
    (FULL.replace("--crash-fraction 0.3", "--crash-fraction 0.5"), "--crash-fraction/--node-fraction"),
    (FULL.replace("--cluster-fraction 0.1 ", "").replace("0.6", "0.9"), "--crash-fraction/--node-fraction"),
    (FULL.replace("--local-save 0.5", "--local-save -1"), "--local-save"),
    (FULL.replace("--local-save 0.5", "--local-save 0"), "--local-save"),
    (FULL.replace("--peer-save 2 ", ""), "--peer-save"),
    (FULL.replace("--persistent-save 30 ", ""), "--persistent-save"),
    (FULL + " --metrics-url file:///etc/passwd", "--metrics-url"),
])
def test_plan_errors_name_the_flag(argv, flag):
    rc, out, err = plan(argv)
    assert rc == 2 and out == ""
    assert err.startswith(f"tierckpt: error: {flag}") and len(err.strip().splitlines()) == 1


def test_readme_plan_examples_run():
    block = README[README.index("## The CLI"):]
    commands = re.findall(r"^(tierckpt plan [^#\n]*?)\s*(?:#.*)?$", block, re.M)
    assert commands, "the README's CLI section shows a plan example"
    for line in commands:
        rc, _out, err = call(*line.split()[1:])
        assert rc == 0, f"{line}: {err}"


@pytest.fixture()
def metrics_server():
    body = (Path(__file__).parent / "test_goodput.py").read_text()
    text = body[body.index('SAMPLE_METRICS = """\\\n') + len('SAMPLE_METRICS = """\\\n'):]
    text = text[:text.index('"""')]

    class Handler(http.server.BaseHTTPRequestHandler):
        payload = text.encode()

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(self.payload)))
            self.end_headers()
            self.wfile.write(self.payload)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()
    thread.join()


def test_plan_flags_win_over_measured_values(metrics_server):
    _, url = metrics_server
    argv = ("--mtbi 4h --crash-fraction 0.3 --node-fraction 0.6 --step-time 2 --local-restore 9 --peer-save 2 "
            f"--persistent-save 30 --persistent-restore 300 --metrics-url {url} --json")
    rc, out, err = plan(argv)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["measured"] == ["local_save", "peer_restore"] and doc["metrics_url"] == url
    assert doc["inputs"]["local_save"] == pytest.approx(0.3)
    assert doc["inputs"]["local_restore"] == 9.0  # the flag wins over the measured 1.5
    assert doc["inputs"]["peer_restore"] == pytest.approx(40.0)
    assert "measured from" in plan(argv.replace(" --json", ""))[1]


def test_plan_rejects_non_prometheus_metrics(metrics_server):
    server, url = metrics_server
    server.RequestHandlerClass.payload = b"<html>{not metrics}</html>\n"
    rc, _, err = plan(FULL + f" --metrics-url {url}")
    assert rc == 2 and "--metrics-url: response of" in err and "is not Prometheus text" in err


def test_plan_unreachable_metrics_url_exits_3():
    url = f"http://127.0.0.1:{_refused_port()}/metrics"
    rc, out, err = plan(FULL + f" --metrics-url {url}")
    assert rc == 3 and out == "" and err.startswith("tierckpt: error: --metrics-url: cannot fetch " + url)
    assert "--metrics-port" in err


def test_plan_measures_restore_times_from_a_real_daemon(daemon, metrics_port, tmp_path):
    assert run("--address", daemon.address, "restore", "job", "--rank", "0", "--out", str(tmp_path / "m"),
               "--quiet").returncode == 0
    rc, out, err = plan(f"--mtbi 4h --step-time 1 --persistent-save 30 --metrics-url 127.0.0.1:{metrics_port} --json")
    assert rc == 0, err
    doc = json.loads(out)
    assert "local_restore" in doc["measured"] and "local_save" in doc["measured"]
    assert 0 < doc["inputs"]["local_restore"] < 30
    assert [t["name"] for t in doc["tiers"]] == ["local", "persistent"]


def test_readme_documents_every_json_command():
    block = README[README.index("## The CLI"):]
    block = block[:block.index("\n## ", 4)]
    for command in ("status", "ls", "latest", "restore", "plan", "policy", "rm", "verify", "persist"):
        assert f"`tierckpt {command}" in block and "--json" in block
    for key in ("peer_tier", "complete_in", "world_size", "source_node", "interval_steps", "defaulted"):
        assert key in block, key


# ------------------------------------------------------------------------- data management


def test_policy_rm_verify_persist_verbs(tmp_path, daemon_factory):
    d = daemon_factory(args=("--persistent", f"file://{tmp_path}/store"))
    a = ("--address", d.address)
    with d.client() as c:
        c.save("dm", 1, 0, 1, {"w": ARR}).result(30)
        c.save("dm", 2, 0, 1, {"w": ARR}).result(30)
    rc, out, err = call(*a, "policy", "dm", "--keep-local", "3", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["overrides"]["keep_local"] == 3 and doc["effective"]["persist_every"] == 0, err
    assert_json_style(doc)
    rc, out, _ = call(*a, "policy", "dm")
    assert rc == 0 and "keep_local       3  (job)" in out
    rc, out, err = call(*a, "verify", "dm", "--json")
    assert rc == 0 and json.loads(out)["mismatches"] == 0, err
    rc, out, err = call(*a, "persist", "dm", "--step", "2", "--wait", "--json")
    assert rc == 0 and json.loads(out)["persisted"] == [0], err
    rc, out, err = call(*a, "persist", "dm", "--step", "99")
    assert rc == 4, err
    f = next((d.local_dir / "jobs" / "dm").glob("*1/rank-*/w.*"))
    f.write_bytes(b"\0" * f.stat().st_size)
    rc, out, err = call(*a, "verify", "dm", "--step", "1")
    assert rc == 1 and "mismatch" in out, (out, err)
    rc, out, err = call(*a, "rm", "dm", "--step", "2", "--json")
    assert rc == 0 and json.loads(out)["local"] == 1 and json.loads(out)["persistent"] == 1, err

