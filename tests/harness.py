"""Test-side name for :mod:`tierckptd.testing` (daemon subprocess launcher)."""

from tierckptd.testing import _BIN_DIR, Daemon, free_port, scratch_dir  # noqa: F401
