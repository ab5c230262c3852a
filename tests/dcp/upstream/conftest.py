"""One tierckptd daemon per test module of tests/dcp/upstream, its address in
``$TIERCKPT_ADDRESS`` while the module runs (the gloo worker processes that
``MultiProcessTestCase`` spawns inherit it)."""

from __future__ import annotations

import os
import shutil

import pytest
from tierckptd.testing import Daemon, scratch_dir

from .storage import ADDRESS_ENV


@pytest.fixture(scope="module", autouse=True)
def upstream_daemon():
    if not os.environ.get("TIERCKPT_PYTORCH_TESTS"):
        yield None  # the tests skip, saying why
        return
    root = scratch_dir("tck-up-")
    d = Daemon(root, "up0").start()
    before = os.environ.get(ADDRESS_ENV)
    os.environ[ADDRESS_ENV] = d.address
    try:
        yield d
    finally:
        if before is None:
            os.environ.pop(ADDRESS_ENV, None)
        else:
            os.environ[ADDRESS_ENV] = before
        d.kill()
        shutil.rmtree(root, ignore_errors=True)
