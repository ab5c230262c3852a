"""The ``tierckpt`` command line: status, ls, latest, restore, policy, rm, verify, persist, doctor, plan, completion.

Error contract (every sub-command; tests/test_cli.py checks each case):

=====  ===================================================================================
exit   meaning
=====  ===================================================================================
0      done; the result is on stdout (one JSON document with ``--json``)
1      anything else: the daemon's or the system's message, one line on stderr
2      bad input: one line on stderr naming the argument; the daemon was not asked
3      the daemon is unreachable or does not answer within ``--timeout``: the address, where
       it came from, and a hint line saying what to check
4      not found: the job, step or rank is in no reachable tier
=====  ===================================================================================

Exit 4 covers every command naming a job or step (``ls``, ``latest``, ``verify``, ``rm``,
``restore``, ``persist``; not ``policy``, which may precede a job's first save).

A failed command leaves nothing behind: ``restore`` creates ``--out`` only once the daemon has
handed over the checkpoint, and prints nothing on stdout. An existing ``--out`` must be empty
unless ``--force``, which replaces it whole (written beside it, then swapped in). Progress goes to stderr, and only when
stderr is a terminal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from .. import __version__
from ..errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, TierckptError, UnavailableError
from ._commands import cmd_latest, cmd_ls, cmd_restore, cmd_status
from ._daemon import DaemonUnreachable, Session
from ._manage import EXAMPLES as _MANAGE_EXAMPLES
from ._manage import register as _register_manage
from .doctor import EXAMPLES as _DOCTOR_EXAMPLES
from .doctor import register as _register_doctor
from .plan import add_plan_arguments, run_plan

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_UNREACHABLE", "EXIT_NOT_FOUND"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NOT_FOUND = 0, 1, 2, 3, 4
PROG = "tierckpt"
_DIRECTORY = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/", "tcsh": "d"}  # shtab.DIRECTORY, without importing it
_SHELLS = ("bash", "zsh")


class _UsageError(Exception):
    """Bad command-line syntax found by argparse (exit 2, one line)."""


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one line (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see {self.prog} --help)")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=min(100, max(60, _columns())))


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns - 2
    except (OSError, ValueError, AttributeError):
        return 98


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _add_connection(p: argparse.ArgumentParser, *, sub: bool) -> None:
    """--address and --timeout, accepted before and after the sub-command (the later one wins)."""
    default: Any = argparse.SUPPRESS if sub else None
    p.add_argument("--address", metavar="ADDRESS", default=default,
                   help="daemon address, unix:///PATH or HOST:PORT (default: $TIERCKPT_ADDRESS, else "
                        "unix:///run/tierckpt/tierckptd.sock)")
    p.add_argument("--timeout", metavar="SECONDS", type=_timeout, default=argparse.SUPPRESS if sub else 30.0,
                   help="how long to wait for the daemon to answer a request (> 0; default 30); a restore's "
                        "data transfer is not limited")


_EXAMPLES = {
    "status": "examples:\n  tierckpt status\n  tierckpt --address 10.0.0.7:7070 status --json",
    "ls": "examples:\n  tierckpt ls llama-70b\n  tierckpt ls llama-70b --ranks    # tiers and nodes of every rank\n"
          "  tierckpt ls llama-70b --json | jq '.checkpoints[-1].complete_in'",
    "latest": "examples:\n  tierckpt latest llama-70b\n  step=$(tierckpt latest llama-70b) || exit",
    "restore": "examples:\n  tierckpt restore llama-70b --rank 0 --out /tmp/r0\n"
               "  tierckpt restore llama-70b --rank 3 --step 1200 --out /tmp/r3 --json",
    "plan": "examples:\n  tierckpt plan --mtbi 4h --step-time 1 --local-save 0.1 --persistent-save 30\n"
            "  tierckpt plan --mtbi 4h --step-time 1 --local-save 0.1 --peer-save 0.4 --persistent-save 30 \\\n"
            "      --metrics-url http://127.0.0.1:9400/metrics --json\n\n"
            "defaults: failure mix crash 0.3, node 0.6, cluster 0.1; a tier's restore time is measured\n"
            "(--metrics-url) or else taken as its save time",
    "completion": "examples:\n  tierckpt completion bash > ~/.local/share/bash-completion/completions/tierckpt\n"
                  "  tierckpt completion zsh > \"${fpath[1]}/_tierckpt\"",
    **_MANAGE_EXAMPLES,
    **_DOCTOR_EXAMPLES,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``tierckpt`` argument parser (also what ``tierckpt completion`` describes)."""
    p = _Parser(prog=PROG, formatter_class=_Formatter,
                description="Inspect and restore the checkpoints of the tierckpt daemon on this node, and plan "
                            "how often to save into each tier.",
                epilog="exit status: 0 ok, 1 error, 2 bad input, 3 daemon unreachable or not answering, "
                       "4 not found.\nRead commands take --json (snake_case keys, integers as numbers).")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}", help="print the version and exit")
    _add_connection(p, sub=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                           epilog=_EXAMPLES[name], formatter_class=_Formatter)
        return s

    s = command("status", "tiers, capacity, drain backlog and peers of the daemon")
    s.add_argument("--json", action="store_true", help="print one JSON document (schema in the README)")
    _add_connection(s, sub=True)
    s.set_defaults(fn=cmd_status)

    s = command("ls", "steps of a job: completeness, the tiers each is complete in, nodes holding it")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--ranks", action="store_true", help="also show, for every rank, the tiers and nodes holding it")
    s.add_argument("--json", action="store_true", help="print one JSON document, per-rank placement included")
    _add_connection(s, sub=True)
    s.set_defaults(fn=cmd_ls)

    s = command("latest", "newest step of a job complete in some tier (exit 4 when there is none)")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--json", action="store_true", help='print {"job": ..., "step": N}')
    _add_connection(s, sub=True)
    s.set_defaults(fn=cmd_latest)

    s = command("restore", "restore one rank into a directory: one file per shard plus checkpoint.json")
    s.add_argument("job", metavar="JOB", help="job name")
    s.add_argument("--rank", metavar="N", type=_int, required=True, help="rank to restore (>= 0)")
    s.add_argument("--step", metavar="N", type=_int, default=None,
                   help="step to restore (default: the latest complete step)")
    s.add_argument("--out", metavar="DIR", required=True,
                   help="output directory, created once the daemon has handed over the checkpoint; an existing "
                        "one must be empty (see --force)")
    s.add_argument("--force", action="store_true",
                   help="replace a non-empty --out whole (written beside it, then swapped in; never a mix)")
    s.add_argument("--quiet", action="store_true", help="no progress bar (there is none unless stderr is a terminal)")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    _add_connection(s, sub=True)
    s.set_defaults(fn=cmd_restore)
    s._actions[[a.dest for a in s._actions].index("out")].complete = _DIRECTORY  # type: ignore[attr-defined]

    _register_manage(command, _add_connection)
    _register_doctor(command, _add_connection)

    s = command("plan", "checkpoint interval per tier that maximises goodput (no daemon needed)")
    add_plan_arguments(s)
    _add_connection(s, sub=True)
    s.set_defaults(fn=None, plan=True)

    from ..certs import register as _register_certs

    _register_certs(sub).set_defaults(local=True)

    s = command("completion", "print a shell completion script")
    s.add_argument("shell", metavar="SHELL", choices=_SHELLS, help="bash or zsh")
    s.set_defaults(fn=None, completion=True)
    return p


def _completion(shell: str, out: TextIO) -> int:
    try:
        import shtab
    except ImportError:
        raise FailedPreconditionError("completion needs the shtab package: pip install shtab") from None
    out.write(shtab.complete(build_parser(), shell=shell))
    return EXIT_OK


def _fail(err: TextIO, message: str, code: int, hint: str | None = None) -> int:
    err.write(f"{PROG}: error: {message}\n")
    if hint:
        err.write(f"{PROG}: hint: {hint}\n")
    err.flush()
    return code


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Runs the CLI and returns its exit status (the console script exits with it).

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).
        out: Where results go (default stdout).
        err: Where errors go (default stderr).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    daemon: Session | None = None
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "completion", False):
            return _completion(args.shell, out)
        if getattr(args, "plan", False):
            return run_plan(args, out, timeout=args.timeout)
        if getattr(args, "local", False):  # certs: no daemon involved
            return int(args.fn(args, out))
        daemon = Session(args.address, args.timeout, os.environ)
        return int(args.fn(args, daemon, out))
    except _UsageError as e:
        return _fail(err, str(e), EXIT_USAGE)
    except InvalidArgumentError as e:
        return _fail(err, str(e), EXIT_USAGE)
    except DaemonUnreachable as e:
        return _fail(err, str(e), EXIT_UNREACHABLE, e.hint)
    except NotFoundError as e:
        return _fail(err, str(e), EXIT_NOT_FOUND)
    except UnavailableError as e:
        # Only --metrics-url (plan) or a tier behind an answering daemon get here.
        return _fail(err, str(e), EXIT_UNREACHABLE if getattr(args, "plan", False) else EXIT_ERROR)
    except TierckptError as e:
        return _fail(err, str(e) or type(e).__name__, EXIT_ERROR)
    except BrokenPipeError:  # stdout closed early (`tierckpt ls job | head`): not an error worth a trace
        if out is sys.stdout:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            except (OSError, ValueError):
                pass
        return EXIT_ERROR
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(err, f"{where}{e.strerror or e}", EXIT_ERROR)
    except KeyboardInterrupt:
        return _fail(err, "interrupted", 130)
    except SystemExit as e:  # --help and --version (argparse prints them and exits 0)
        return e.code if isinstance(e.code, int) else EXIT_OK
    finally:
        if daemon is not None:
            daemon.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
