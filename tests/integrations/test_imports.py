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


def _loaded_after(statement: str) -> list[str]:
    """The client modules (tierckpt.* beyond the shared kernel), grpc and numpy loaded by ``statement``."""
    code = (f"import sys\n{statement}\n"
            "kernel = ('tierckpt', 'tierckpt.errors', 'tierckpt.common')\n"
            "bad = [n for n in sys.modules if n.startswith('tierckpt.') and n not in kernel\n"
            "       and not n.startswith('tierckpt.common.')]\n"
            "bad += [n for n in ('grpc', 'numpy') if n in sys.modules]\n"
            "print(','.join(sorted(bad)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return out.split(",") if out else []


def test_the_shared_kernel_loads_no_client_module():
    """The daemon shares tierckpt.errors and tierckpt.common (names, checksum, fileio) with the
    client; importing them must not run the client (its modules, grpc, numpy)."""
    assert _loaded_after("import tierckpt.errors") == []
    assert _loaded_after("import tierckpt.common.names, tierckpt.common.checksum, tierckpt.common.fileio") == []
    # The daemon's pure layout modules load no client code either.
    assert _loaded_after("import tierckptd.persistent.layout, tierckptd.local.manifest, tierckptd.cluster.ring") == []


def test_the_lazy_package_still_offers_the_public_names():
    import tierckpt

    for name in tierckpt.__all__:
        assert getattr(tierckpt, name) is not None, name
    assert set(tierckpt.__all__) <= set(dir(tierckpt))
    # A name that does not exist is still an AttributeError (hasattr, mocks and `from x import` rely on it).
    assert not hasattr(tierckpt, "NoSuchName")
    assert _loaded_after("import tierckpt; tierckpt.Client")  # the client loads on first use
