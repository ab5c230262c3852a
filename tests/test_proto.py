"""The committed generated code must match protos/ (regenerate with `make proto`)."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / "client" / p, shallow=False)]
    assert not stale, f"generated code is stale; run `make proto`: {stale}"
