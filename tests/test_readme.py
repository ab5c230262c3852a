"""The README documents every daemon option and the two commands, and its quick start runs."""

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tierckptd.config import DaemonConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_option_is_documented():
    missing = [f.name for f in dataclasses.fields(DaemonConfig)
               if f"`--{f.name.replace('_', '-')}` | `{f.name}`" not in README]
    assert not missing, f"README configuration table lacks {missing}; paste tierckptd.config.options_markdown()"


def test_two_commands_are_shown():
    assert "make demo" in README and "make test" in README


def _quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The README's quick start, line by line, in a temporary directory: the daemon line in the
    background (the test waits for its socket, as a person typing would), the rest with bash -e."""
    lines = _quick_start()
    assert 3 <= len(lines) <= 10, lines  # "in under ten lines"
    local, sock, out = tmp_path / "local", tmp_path / "t.sock", tmp_path / "hello"

    def here(line: str) -> str:
        return (line.replace("/dev/shm/tierckpt", str(local)).replace("/tmp/tierckpt.sock", str(sock))
                .replace("/tmp/hello", str(out)))

    daemon_line = here(lines[0]).split("#", 1)[0].strip()
    assert daemon_line.endswith("&") and daemon_line.startswith("tierckptd "), lines[0]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    daemon = subprocess.Popen(shlex.split(daemon_line[:-1]), env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert daemon.poll() is None, daemon.stdout.read().decode() if daemon.stdout else ""
            assert time.monotonic() < deadline, "the daemon made no socket in 60 s"
            time.sleep(0.1)
        script = "set -e\n" + "\n".join(here(line) for line in lines[1:])
        p = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "array([0., 1., 2., 3.])" in p.stdout, p.stdout
        assert "1/1" in p.stdout and "local" in p.stdout, p.stdout  # tierckpt ls hello
        assert (out / "checkpoint.json").is_file(), sorted(x.name for x in out.iterdir())
    finally:
        daemon.terminate()
        daemon.wait(30)
