"""The declared test dependencies are required: a missing one fails the run, naming it.

What ``make test`` installs is declared once: pyproject.toml's dependencies and the extras of
:data:`EXTRAS` (the Makefile's ``pip install -e '.[daemon,s3,gcs,torch,dev]'``), and
requirements-test.txt. ``tests/conftest.py`` checks them at session start, so a broken install
stops the run with the package's name instead of turning tests that need it into skips.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("daemon", "s3", "gcs", "torch", "dev")  # the Makefile's venv target


def declared(root: Path = ROOT, extras: Iterable[str] = EXTRAS, tests: bool = True) -> list[str]:
    """Every requirement line ``make test`` installs (the project's own extras expanded; with
    ``tests``, requirements-test.txt's too)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    lines = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if req.name == project["name"]:
                todo.extend(req.extras)
            else:
                lines.append(line)
    for line in (root / "requirements-test.txt").read_text().splitlines() if tests else []:
        line = line.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def unmet(lines: Iterable[str]) -> list[str]:
    """The requirements among ``lines`` that the running environment does not satisfy, each as
    ``name (why)``."""
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} ({version} installed, {req.specifier} declared)")
    return sorted(set(out))
