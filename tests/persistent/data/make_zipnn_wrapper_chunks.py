"""Writes zipnn_wrapper_chunks.json (beside it): chunks stored by the zipnn-* codecs of 8d8af13,
which went through the zipnn wrapper. Run against that tree, not this one::

    git archive 8d8af13 client daemon | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/client:/tmp/old/daemon python tests/persistent/data/make_zipnn_wrapper_chunks.py \\
        > tests/persistent/data/zipnn_wrapper_chunks.json

The plain bytes are test_codec.py's ``_wrapper_plain`` (the same arithmetic as ``plain`` here).
"""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import xxhash


def plain(kind: str, count: int, modulus: int, tail: bytes) -> bytes:
    x = (((np.arange(count, dtype=np.int64) * 2654435761) % modulus - modulus // 2).astype(np.float32)
         * np.float32(1e-5))
    body = {"f32": x.tobytes(), "f16": x.astype(np.float16).tobytes(),
            "bf16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()}[kind]
    return body + tail


def main() -> None:
    from tierckptd.persistent import compress

    assert hasattr(compress, "_zipnn"), "run against the wrapper-based compress.py (8d8af13)"
    out = []
    for codec, kind in [("zipnn-bf16", "bf16"), ("zipnn-f16", "f16"), ("zipnn-f32", "f32")]:
        width = 4 if kind == "f32" else 2
        for count, modulus, tail in [(1024, 2001, b"\x05\x06\x07"[: width - 1]), (1024, 2001, b""),
                                     ((262_144 + 4096) // width, 3, b"\x09")]:
            data = plain(kind, count, modulus, tail)
            stored = compress.encode(codec, data)
            assert stored[:1] == b"\x01", (codec, count)
            out.append({"codec": codec, "kind": kind, "count": count, "modulus": modulus, "tail": tail.hex(),
                        "size": len(data), "plain_xxh3": xxhash.xxh3_64_hexdigest(data),
                        "stored": base64.b64encode(stored).decode()})
    json.dump({"note": "chunks stored by tierckptd's zipnn-* codecs through the zipnn 0.5.4 wrapper "
                       "(compress.py of 8d8af13 and before); plain bytes: tests/persistent/test_codec.py "
                       "_wrapper_plain", "chunks": out}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
