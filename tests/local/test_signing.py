"""Manifest MACs (tierckptd.local.signing) on the parser itself: every field is covered, a missing
or foreign MAC is data loss, and nothing changes for a node without a key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierckpt.errors import DataLossError
from tierckptd.local import signing
from tierckptd.local.manifest import Manifest, ShardEntry, unsigned_note

KEY = b"k" * 32


@pytest.fixture
def keyed():
    signing.configure(signing.ManifestKey(KEY, accept_unsigned=False))
    yield
    signing.configure(signing.ManifestKey())


def _man() -> Manifest:
    return Manifest("job", 7, 1, 4, "n0", "g" * 16, (ShardEntry("w", 8, "0" * 16, "<f4", (2,), "w.bin"),),
                    metadata_json='{"lr": 0.1}', created=1.5)


EDITS = {
    "step": 8, "rank": 2, "world_size": 8, "node": "n1", "generation": "h" * 16, "metadata_json": '{"lr": 9}',
    "created": 2.5, "persist": True,
}
SHARD_EDITS = {"checksum": "1" * 16, "size": 4, "dtype": "<i4", "shape": [1, 2], "file": "x.bin", "name": "v"}


def test_a_signed_manifest_round_trips(keyed) -> None:
    body = _man().to_json()
    assert len(json.loads(body)["mac"]) == 64
    back = Manifest.from_json(body)
    assert back == _man() and not back.unsigned


@pytest.mark.parametrize("field", sorted(EDITS))
def test_an_edit_of_any_field_is_data_loss(keyed, field: str) -> None:
    doc = json.loads(_man().to_json())
    doc[field] = EDITS[field]
    with pytest.raises(DataLossError, match="signature does not match"):
        Manifest.from_json(json.dumps(doc))


@pytest.mark.parametrize("field", sorted(SHARD_EDITS))
def test_an_edit_of_any_shard_field_is_data_loss(keyed, field: str) -> None:
    doc = json.loads(_man().to_json())
    doc["shards"][0][field] = SHARD_EDITS[field]
    if field in ("size", "dtype", "shape"):
        doc["shards"][0].update(size=8, dtype="<i4", shape=[2])  # still a consistent layout: only the MAC catches it
    with pytest.raises(DataLossError, match="signature does not match"):
        Manifest.from_json(json.dumps(doc))


def test_another_key_or_no_mac_is_data_loss(keyed) -> None:
    body = _man().to_json()
    signing.configure(signing.ManifestKey(b"x" * 32, accept_unsigned=False))
    with pytest.raises(DataLossError, match="another cluster"):
        Manifest.from_json(body)
    doc = json.loads(body)
    del doc["mac"]
    with pytest.raises(DataLossError, match="not signed"):
        Manifest.from_json(json.dumps(doc))
    doc["mac"] = "zz"
    with pytest.raises(DataLossError, match="HMAC-SHA256"):
        Manifest.from_json(json.dumps(doc))


def test_accept_unsigned_reads_them_and_marks_them(keyed) -> None:
    signing.configure(signing.ManifestKey(KEY, accept_unsigned=True))
    doc = json.loads(_man().to_json())
    del doc["mac"]
    got = Manifest.from_json(json.dumps(doc))
    assert got.unsigned and "unsigned manifest" in unsigned_note(got, "")
    assert unsigned_note(_man(), "fine") == "fine"


def test_without_a_key_nothing_is_signed_or_refused() -> None:
    body = _man().to_json()
    assert "mac" not in json.loads(body)
    assert not Manifest.from_json(body).unsigned  # no key: nothing to report either


def test_key_files(tmp_path: Path) -> None:
    good = tmp_path / "k"
    good.write_bytes(b"  " + b"a" * 40 + b"\n")
    good.chmod(0o640)
    assert signing.load_key(str(good)) == b"a" * 40
    good.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        signing.load_key(str(good))
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ValueError, match="cannot open"):
        signing.load_key(str(link))
