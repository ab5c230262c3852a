"""No torch in the daemon (issue 28): the float codecs are byte planes + zstd (``bp*-zstd``), and
the legacy ZipNN chunks (``zipnn-*``) are decoded in a child process, so neither the daemon's codec
path (every codec, the legacy ones included) nor a running daemon that drained and restored bf16,
f16 and f32 shards under every ``codec`` setting has torch, the zipnn wrapper or even ``zipnn_core``
loaded. The test process itself may import torch (it is a client: bfloat16 shards are torch tensors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tierckptd.persistent import compress

_PROBE = """
import json, sys
import numpy as np
import tierckptd.main  # the daemon's whole import graph
from tierckptd.persistent import compress
rng = np.random.default_rng(0)
x = (rng.standard_normal(200_001) * 0.02).astype(np.float32)
shards = {"float32": x.tobytes(), "float16": x.astype(np.float16).tobytes(),
          "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()}
used = set()
for setting in compress.SETTINGS:
    for dtype, plain in shards.items():
        for data in (plain, plain + b"\\x01", plain[:3]):
            codec = compress.choose(setting, dtype)
            used.add(codec)
            assert bytes(compress.decode(codec, compress.encode(codec, data), len(data))) == data
golden = json.loads(open(sys.argv[1]).read())
x = (((np.arange(1024, dtype=np.int64) * 2654435761) % 2001 - 1000).astype(np.float32) * np.float32(1e-5))
plain = {"f32": x.tobytes() + b"\x05", "bf16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes() + b"\x05"}
for codec, g in golden.items():  # every name ever written, ZipNN's included (decoded in a child)
    used.add(codec)
    assert bytes(compress.decode(codec, bytes.fromhex(g["stored"]), len(plain[g["plain"]]))) == plain[g["plain"]]
print(json.dumps({"codecs": sorted(used), "modules": sorted(m for m in ("torch", "zipnn", "safetensors",
                  "zipnn_core", "blosc2") if m in sys.modules)}))
"""


def test_the_daemon_codec_path_never_imports_torch() -> None:
    """Every codec of every setting round-trips float chunks, and stored chunks of every codec
    name decode, in a fresh interpreter that imported the daemon: torch, safetensors, the zipnn
    wrapper and zipnn_core are not loaded."""
    golden = Path(__file__).parent / "data" / "golden_chunks.json"
    out = subprocess.run([sys.executable, "-c", _PROBE, str(golden)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"bp2-zstd", "bp4-zstd", "bg2-zstd", "zipnn-f32", "zipnn-bf16"} <= set(got["codecs"])
    assert got["modules"] == []


def _loaded(pid: int) -> set[str]:
    """The shared objects a process has mapped (a torch import maps libtorch and torch/_C)."""
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if ".so" in line}


def _torch_free(pid: int) -> None:
    libs = _loaded(pid)
    assert not [lib for lib in libs if "torch" in lib or "safetensors" in lib or "zipnn" in lib], libs


@pytest.mark.slow
@pytest.mark.parametrize("setting", compress.SETTINGS)
def test_a_daemon_drains_and_restores_float_shards_without_torch(daemon_factory, tmp_path: Path,
                                                                  setting: str) -> None:
    url = (tmp_path / "store").as_uri()
    x = (np.random.default_rng(28).standard_normal(300_001) * 0.02).astype(np.float32)
    shards = {"f32": x, "f16": x.astype(np.float16), "bf16": torch.from_numpy(x).to(torch.bfloat16),
              "odd": np.frombuffer(x.tobytes()[:999], np.uint8)}
    plain = {name: (a.view(torch.int16).numpy() if name == "bf16" else a).tobytes() for name, a in shards.items()}
    d = daemon_factory("a", args=("--persistent", url, "--persist-every", "1", "--codec", setting))
    with d.client() as c:
        c.save("job", 1, 0, 1, shards).wait("persistent", timeout=60)
    _torch_free(d.proc.pid)  # it encoded
    d.kill()
    d.wipe()
    d.start()
    with d.client() as c:
        started = time.monotonic()
        ck = c.restore("job", 0, step=1)
        assert ck.tier == "persistent", time.monotonic() - started
        assert {n: ck.shards[n].tobytes() for n in shards} == plain  # bytes() refuses float16's buffer
    _torch_free(d.proc.pid)  # it decoded
    d.kill()
    from tierckptd.backends import open_backend
    from tierckptd.local.manifest import Manifest
    from tierckptd.persistent import manifest_key

    with open_backend(url) as be:
        man = Manifest.from_json(be.get_bytes(manifest_key("job", 1, 0, 1)))
    want = {n: compress.choose(setting, s.dtype) for n, s in ((s.name, s) for s in man.shards)}
    assert {s.name: s.codec for s in man.shards} == want
    if setting == "auto":
        assert [want[n] for n in ("f32", "f16", "bf16")] == ["bp4-zstd", "bp2-zstd", "bp2-zstd"]
