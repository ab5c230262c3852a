"""The README documents every daemon option and the two commands."""

import dataclasses
from pathlib import Path

from tierckptd.config import DaemonConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_option_is_documented():
    missing = [f.name for f in dataclasses.fields(DaemonConfig)
               if f"`--{f.name.replace('_', '-')}` | `{f.name}`" not in README]
    assert not missing, f"README configuration table lacks {missing}; paste tierckptd.config.options_markdown()"


def test_two_commands_are_shown():
    assert "make demo" in README and "make test" in README
