"""Put on ``PYTHONPATH`` by tests/dcp/upstream/test_pytorch_dcp_tests.py for the pytest run of
PyTorch's test files and every process it spawns: with ``TIERCKPT_UPSTREAM_DCP=1`` each
interpreter swaps DCP's filesystem storage for tierckpt's before the test module imports it
(``MultiProcessTestCase``'s spawned ranks re-import the module, so it must happen at start-up)."""

import os

if os.environ.get("TIERCKPT_UPSTREAM_DCP") == "1":
    from tests.dcp.upstream.storage import install, torch_compat

    install()
    torch_compat()
