"""The client stays thin: no cloud SDK in its dependencies or its imports."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_base_dependencies_have_no_cloud_sdk_or_daemon_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    for heavy in ("boto", "google-cloud", "torch", "uvloop", "prometheus", "aiofiles"):
        assert heavy not in base
    assert set(project["optional-dependencies"]) >= {"daemon", "torch", "dev", "s3", "gcs"}
    assert project["scripts"] == {"tierckptd": "tierckptd.main:main", "tierckpt": "tierckpt.cli:main"}


def test_importing_the_client_loads_no_cloud_sdk_torch_or_daemon():
    code = ("import sys, tierckpt, tierckpt.cli, tierckpt.goodput\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('boto3', 'botocore', 'torch', 'tierckptd', 'uvloop', 'prometheus_client') "
            "or m.startswith('google.cloud')]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_declared_test_dependencies_are_required(monkeypatch):
    """tests/deps.py: what make test installs is checked at session start; a missing or too old
    package fails the run, named (tests import declared packages plainly: no skips)."""
    import pytest
    from packaging.requirements import Requirement

    from . import conftest, deps

    lines = deps.declared()
    assert {"hypothesis", "torch", "jax", "transformers", "pytorch-lightning", "shtab", "cryptography", "pyyaml",
            "kubernetes-validate", "boto3", "google-cloud-storage"} <= {Requirement(line).name for line in lines}
    assert deps.unmet(lines) == []
    assert deps.unmet(["tierckpt-no-such-package>=1", "pytest<1", "numpy"]) == [
        f"pytest ({pytest.__version__} installed, <1 declared)", "tierckpt-no-such-package (not installed)"]
    monkeypatch.setattr(deps, "unmet", lambda lines: ["jax (not installed)"])
    with pytest.raises(pytest.UsageError, match=r"missing or too old: jax \(not installed\)"):
        conftest.pytest_sessionstart(None)


def test_the_daemon_extra_installs_no_torch_and_no_zipnn():
    """Issue 28: ``pip install 'tierckpt[daemon]'`` pulls no torch: neither torch nor zipnn (whose
    distribution declares torch) is a requirement of the extra, its nested extras included. The
    legacy ZipNN reader is installed apart (``pip install --no-deps``), as README says."""
    from packaging.requirements import Requirement

    from . import deps

    names = {Requirement(line).name.lower() for line in deps.declared(extras=("daemon",), tests=False)}
    assert {"zstandard", "numpy"} <= names
    assert not {n for n in names if "torch" in n or "zipnn" in n}, names
    readme = (ROOT / "README.md").read_text()
    assert "pip install --no-deps 'zipnn>=0.5.4,<0.6'" in readme
