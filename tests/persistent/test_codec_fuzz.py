"""Stored bytes cannot drive the decoders (issue 27): malformed chunks of every codec give
DataLossError, never another exception, a crash or more bytes than the chunk's size.

Thousands of malformed chunks per codec: truncations, bit flips, random bodies, and forgeries that
keep the framing valid (plane lengths, zstd frames announcing other sizes, ZipNN streams with a
recomputed digest). A decode either raises DataLossError or returns exactly the chunk's size (a
flipped bit in a raw plane decodes to other bytes of the right size: the tier's content hash
catches those, tests/persistent/test_content.py). ZipNN's C decoder runs in a child process (it
crashed the daemon on a forged stream); its isolation is tested with stand-in modules that crash,
hang or are missing. The long variant (``-m long``) runs ten times as many cases.
"""

from __future__ import annotations

import os
import random
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from tierckpt.errors import DataLossError, FailedPreconditionError
from tierckptd.persistent import compress, zipnn

_CODECS = {"raw": "float32", "zstd": "float32", "bp2-zstd": "bfloat16", "bp4-zstd": "float32",
           "bg2-zstd": "bfloat16", "bg4-zstd": "float32", "zipnn-bf16": "bfloat16", "zipnn-f16": "float16",
           "zipnn-f32": "float32"}


def _plain(dtype: str, count: int, seed: int) -> bytes:
    x = (np.random.default_rng(seed).standard_normal(count) * 0.02).astype(np.float32)
    body = {"float32": x.tobytes(), "float16": x.astype(np.float16).tobytes(),
            "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()}[dtype]
    return body + b"\x07"


def _frame(size: int, block: bytes = b"\x00") -> bytes:
    """A zstd frame announcing ``size`` bytes (single segment, 8-byte content size) holding one
    RLE block of 1 byte: what a bucket writer would make to have a decoder allocate ``size``."""
    return (struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", size)
            + (1 | (1 << 1) | (1 << 3)).to_bytes(3, "little") + block)


def _planes(body: bytes, width: int) -> list[tuple[int, bytes]]:
    pos, out = 0, []
    for _ in range(width):
        length = int.from_bytes(body[pos + 1:pos + 5], "little")
        out.append((body[pos], body[pos + 5:pos + 5 + length]))
        pos += 5 + length
    return [*out, (-1, body[pos:])]


def _join(planes: list[tuple[int, bytes]]) -> bytes:
    return b"\x01" + b"".join(bytes([m]) + len(p).to_bytes(4, "little") + p if m >= 0 else p for m, p in planes)


def _forgeries(codec: str, stored: bytes, rng: random.Random, n: int) -> list[bytes]:
    """Malformed chunks whose framing is recomputed (they get past the first length checks)."""
    out: list[bytes] = []
    if stored[:1] != b"\x01":  # stored raw: nothing to forge
        return out
    if codec.startswith(("bp", "bg")):
        width = int(codec[2])
        planes = _planes(stored[1:], width + (codec.startswith("bg")))
        for _ in range(n):
            p = list(planes)
            k = rng.randrange(len(p) - (codec.startswith("bp")))
            mode, body = p[k]
            choice = rng.randrange(4)
            if choice == 0:  # another body, its length fixed up
                cut = body[:rng.randrange(len(body) + 1)]
                body = rng.randbytes(rng.randrange(1, 64)) if rng.random() < 0.5 else cut
            elif choice == 1:  # a zstd frame announcing another size, up to 1 TiB
                body, mode = _frame(rng.choice([0, 1, len(body) + 1, 1 << 20, 1 << 40])), 1
            elif choice == 2:  # the mode byte
                mode = rng.randrange(256)
            else:  # bits of the body flipped
                b = bytearray(body)
                for _ in range(rng.randrange(1, 4)):
                    if b:
                        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                body = bytes(b)
            p[k] = (mode if mode >= 0 else -1, body)
            out.append(_join(p))
    elif codec == "zstd":
        out += [b"\x01" + _frame(s) for s in (0, 1, 1 << 20, 1 << 40) for _ in range(max(1, n // 40))]
    elif codec.startswith("zipnn"):  # the stream edited past its header, the digest recomputed
        tail = len(stored) - 9 - int.from_bytes(stored[9 + 24:9 + 32], "little")
        end = len(stored) - tail
        for _ in range(n):
            stream = bytearray(stored[9:end])
            for _ in range(rng.randrange(1, 4)):
                stream[rng.randrange(32, len(stream))] ^= 1 << rng.randrange(8)
            digest = xxhash.xxh3_64_intdigest(bytes(stream) + stored[end:]).to_bytes(8, "little")
            out.append(b"\x01" + digest + bytes(stream) + stored[end:])
    return out


def _malformed(codec: str, stored: bytes, rng: random.Random, n: int, forged: int) -> list[bytes]:
    cases = [stored[:k] for k in rng.sample(range(len(stored)), min(len(stored), n // 4))]
    for _ in range(n // 4):
        b = bytearray(stored)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    cases += [bytes([rng.choice([0, 1, 1, 2])]) + rng.randbytes(rng.randrange(2 * len(stored))) for _ in range(n // 4)]
    cases += [stored + rng.randbytes(rng.randrange(1, 9)) for _ in range(n // 8)]
    return cases + _forgeries(codec, stored, rng, forged)


def _fuzz(codec: str, n: int, forged: int) -> tuple[int, int]:
    """(malformed chunks refused, malformed chunks tried)."""
    rng = random.Random(f"{codec}-{n}")
    refused = tried = 0
    for count in (1, 1000, 40_000):  # one element, a small chunk, planes sampled before coding
        plain = _plain(_CODECS[codec], count, count)
        stored = compress.encode(codec, plain)
        assert bytes(compress.decode(codec, stored, len(plain))) == plain
        for bad in _malformed(codec, stored, rng, n, forged if count == 40_000 else forged // 4):
            tried += 1
            try:
                out = compress.decode(codec, bad, len(plain))
            except DataLossError:
                refused += 1
                continue
            assert len(out) == len(plain), (codec, len(out))
    return refused, tried


@pytest.mark.parametrize("codec", list(_CODECS))
def test_malformed_chunks_of_every_codec_are_data_loss_never_a_crash(codec: str) -> None:
    """~3,000 malformed chunks per codec (over three chunk sizes); ZipNN's forgeries that get past
    the digest go to its isolated decoder (a process each: fewer of them here, more in -m long)."""
    refused, tried = _fuzz(codec, 800, 40 if codec.startswith("zipnn") else 400)
    assert tried > 1800 and refused > tried // 3  # raw planes take flipped bits: the content hash sees them


@pytest.mark.long
@pytest.mark.parametrize("codec", list(_CODECS))
def test_malformed_chunks_long(codec: str) -> None:
    refused, tried = _fuzz(codec, 8000, 400 if codec.startswith("zipnn") else 4000)
    assert tried > 18000 and refused > tried // 3


@pytest.mark.parametrize("codec", ["zstd", "bp2-zstd", "bp4-zstd", "bg2-zstd", "bg4-zstd"])
@pytest.mark.parametrize("announced", [1 << 20, 1 << 40])
def test_a_zstd_frame_announcing_more_than_the_chunk_is_refused_before_decoding(codec: str, announced: int) -> None:
    """zstandard sizes its output by the frame's header, not by max_output_size: a 15-byte frame
    announcing 1 TiB would be allocated. The frame must announce exactly the size it is read as."""
    plain = _plain(_CODECS[codec], 1000, 3)
    if codec == "zstd":
        forged = b"\x01" + _frame(announced)
    else:
        planes = _planes(compress.encode(codec, plain)[1:], int(codec[2]) + codec.startswith("bg"))
        planes[0] = (1, _frame(announced))
        forged = _join(planes)
    with pytest.raises(DataLossError, match="announces"):
        compress.decode(codec, forged, len(plain))


# -------------------------------------------------------------- ZipNN's decoder, isolated


def _stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """A ``zipnn_core`` that the decoder's child process imports first (PYTHONPATH)."""
    (tmp_path / "zipnn_core.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))


def _zipnn_chunk() -> tuple[bytes, bytes]:
    plain = _plain("float32", 5000, 9)
    return plain, compress.encode("zipnn-f32", plain)


def test_a_crash_of_zipnns_decoder_is_data_loss_and_the_process_goes_on(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    plain, stored = _zipnn_chunk()
    _stand_in(tmp_path, monkeypatch, "import os\ndef combine_dtype(*a):\n    os.abort()\n")
    with pytest.raises(DataLossError, match="signal 6"):
        compress.decode("zipnn-f32", stored, len(plain))
    _stand_in(tmp_path, monkeypatch, "def combine_dtype(*a):\n    return b'x' * 5\n")
    with pytest.raises(DataLossError, match="gave 5 bytes"):
        compress.decode("zipnn-f32", stored, len(plain))
    monkeypatch.setattr(zipnn, "DECODE_TIMEOUT", 1.0)
    _stand_in(tmp_path, monkeypatch, "import time\ndef combine_dtype(*a):\n    time.sleep(30)\n")
    with pytest.raises(DataLossError, match="killed"):
        compress.decode("zipnn-f32", stored, len(plain))
    monkeypatch.undo()
    assert compress.decode("zipnn-f32", stored, len(plain)) == plain  # the real one, in its own process


def test_without_zipnn_core_a_zipnn_chunk_names_the_command_that_installs_it(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    plain, stored = _zipnn_chunk()
    _stand_in(tmp_path, monkeypatch, "raise ImportError('not here')\n")  # the child cannot import it
    with pytest.raises(FailedPreconditionError, match=r"zipnn-f32.*pip install --no-deps 'zipnn>=0.5.4,<0.6'"):
        compress.decode("zipnn-f32", stored, len(plain))
    monkeypatch.setattr(zipnn.importlib.util, "find_spec", lambda name: None)  # nor this process
    with pytest.raises(FailedPreconditionError, match="pip install --no-deps"):
        compress.decode("zipnn-f32", stored, len(plain))
