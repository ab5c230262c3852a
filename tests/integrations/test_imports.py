"""The integrations stay optional: importing tierckpt (CheckpointManager included) loads no framework."""

import subprocess
import sys


def test_import_loads_no_framework():
    code = ("import sys, tierckpt\n"
            "m = tierckpt.CheckpointManager\n"
            "names = ('torch', 'jax', 'transformers', 'pytorch_lightning', 'lightning')\n"
            "bad = [n for n in names if n in sys.modules]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
