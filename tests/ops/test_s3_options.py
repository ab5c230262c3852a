"""S3 options for MinIO, Ceph and AWS (endpoint, region, addressing style, SSE, storage class),
checked on the objects a real S3-compatible server (moto) stores, and the bucket lifecycle example."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tierckptd.backends import backend_options, open_backend
from tierckptd.config import ConfigError, load_config

from ..servers import make_backend_target

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MiB = 1 << 20


@pytest.mark.parametrize(("values", "key"), [
    ({"s3_endpoint": "minio:9000"}, "s3_endpoint"),
    ({"s3_endpoint": "https://user:secret@minio:9000"}, "s3_endpoint"),
    ({"s3_region": "EU West"}, "s3_region"),
    ({"s3_addressing_style": "dns"}, "s3_addressing_style"),
    ({"s3_sse": "aes256"}, "s3_sse"),
    ({"s3_sse_kms_key_id": "k"}, "s3_sse_kms_key_id"),
    ({"s3_storage_class": "glacier please"}, "s3_storage_class"),
])
def test_bad_s3_options_name_the_key(values: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}:") as e:
        load_config(values)
    assert "secret" not in str(e.value)


def test_backend_options_only_for_s3_urls() -> None:
    cfg = load_config({"persistent": "s3://b/p", "s3_endpoint": "http://minio:9000", "s3_region": "us-east-1",
                       "s3_addressing_style": "path", "s3_sse": "aws:kms", "s3_sse_kms_key_id": "alias/ckpt",
                       "s3_storage_class": "STANDARD_IA"})
    assert backend_options(cfg) == {"endpoint_url": "http://minio:9000", "region": "us-east-1",
                                    "addressing_style": "path", "sse": "aws:kms", "sse_kms_key_id": "alias/ckpt",
                                    "storage_class": "STANDARD_IA"}
    assert backend_options(load_config({"persistent": "file:///x", "s3_sse": "AES256"})) == {}


@pytest.fixture
def s3(request, tmp_path, monkeypatch):
    target = make_backend_target("s3", request, tmp_path, monkeypatch)
    endpoint = target.env["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the endpoint comes from the option, not the environment
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    target.env.pop("AWS_ENDPOINT_URL")
    target.env.pop("AWS_DEFAULT_REGION")
    return target, endpoint


def _head(be, key: str) -> dict:
    return be.client.head_object(Bucket=be.bucket, Key=be.prefix + key)


@pytest.mark.parametrize(("sse", "kms"), [("AES256", None), ("aws:kms", "alias/tierckpt")])
def test_sse_and_storage_class_on_every_object(s3, tmp_path: Path, sse: str, kms: str | None) -> None:
    from boto3.s3.transfer import TransferConfig

    target, endpoint = s3
    small = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    with open_backend(target.url, endpoint_url=endpoint, region="eu-west-1", addressing_style="path",
                      sse=sse, sse_kms_key_id=kms, storage_class="STANDARD_IA", transfer_config=small) as be:
        assert be.client.meta.region_name == "eu-west-1"
        assert be.client.meta.config.s3["addressing_style"] == "path"
        big = tmp_path / "big"
        big.write_bytes(os.urandom(11 * MiB))  # multipart: three parts
        be.put_file("job/data/big", big)
        be.put_bytes("job/manifests/m.json", b"{}")
        for key in ("job/data/big", "job/manifests/m.json"):
            head = _head(be, key)
            assert head["ServerSideEncryption"] == sse, key
            assert head["StorageClass"] == "STANDARD_IA", key
            if kms:
                assert kms in head.get("SSEKMSKeyId", ""), key
        assert be.get_bytes("job/manifests/m.json") == b"{}"


def test_daemon_drains_with_the_configured_options(s3, daemon_factory) -> None:
    target, endpoint = s3
    d = daemon_factory("n0", env=target.env, args=(
        "--persistent", target.url, "--persist-every", "1", "--s3-endpoint", endpoint, "--s3-region", "us-east-1",
        "--s3-addressing-style", "path", "--s3-sse", "AES256", "--s3-storage-class", "REDUCED_REDUNDANCY"))
    with d.client() as c:
        assert c.status().persistent_error == ""
        c.save("job", 3, 0, 1, {"model": b"x" * 1000}).wait("persistent", timeout=60)
    with open_backend(target.url, endpoint_url=endpoint, region="us-east-1") as be:
        keys = be.list("job/")
        assert any("/manifests/" in k for k in keys) and any("/content/" in k for k in keys)  # chunks
        for key in keys:
            head = _head(be, key)
            assert head["ServerSideEncryption"] == "AES256" and head["StorageClass"] == "REDUCED_REDUNDANCY", key


def test_lifecycle_example_aborts_incomplete_multipart_uploads(s3) -> None:
    target, endpoint = s3
    rules = json.loads((DEPLOY / "s3-lifecycle.json").read_text())
    (rule,) = rules["Rules"]
    assert rule["Status"] == "Enabled" and rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    with open_backend(target.url, endpoint_url=endpoint, region="us-east-1") as be:
        be.client.put_bucket_lifecycle_configuration(Bucket=be.bucket, LifecycleConfiguration=rules)
        got = be.client.get_bucket_lifecycle_configuration(Bucket=be.bucket)["Rules"]
    assert got[0]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
