"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores (MinIO, Ceph RGW), via boto3 and s3transfer.

Credentials come from the standard AWS environment and config files (``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, instance roles, ...), which boto3 reads itself; so do the endpoint and region
unless the daemon's ``s3_endpoint`` / ``s3_region`` keys give them. ``s3_addressing_style``,
``s3_sse`` (+ ``s3_sse_kms_key_id``) and ``s3_storage_class`` apply to every object written.
This module never reads ``os.environ``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, BinaryIO

from tierckpt.errors import NotFoundError, TierckptError

from ..redact import redact_text, redact_url  # no secret in a log or an error
from .base import Backend, BackendError, MissingExtraError, check_key, check_limit, check_prefix, translate_errors

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig

__all__ = ["S3Backend", "default_transfer_config"]

MiB = 1 << 20
_DELETE_BATCH = 1000  # DeleteObjects limit
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_RETRYABLE_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "RequestLimitExceeded", "SlowDown", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "PriorRequestNotComplete",
})


def _load_sdk() -> SimpleNamespace:
    """Import boto3 and friends now (not when tierckptd is imported), or say what to install."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
        import s3transfer.exceptions
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
    except ImportError as e:
        raise MissingExtraError(
            f"persistent: s3:// needs boto3, which cannot be imported ({e}); "
            "install it with: pip install 'tierckpt[s3]'"
        ) from e
    return SimpleNamespace(
        boto3=boto3, Config=botocore.config.Config, bexc=botocore.exceptions, sexc=s3transfer.exceptions,
        TransferConfig=TransferConfig, create_transfer_manager=create_transfer_manager,
    )


def default_transfer_config() -> TransferConfig:
    """Return the TransferConfig the backend uses unless told otherwise.

    64 MiB parts above 64 MiB (a 10 GiB shard is 160 parts; beyond 625 GiB s3transfer raises the
    part size itself to stay within S3's 10,000-part limit),
    16 concurrent part requests per backend (the pool is shared by every transfer in flight, so
    this bounds the backend's total concurrency), classic s3transfer (not the CRT client).
    """
    return _load_sdk().TransferConfig(
        multipart_threshold=64 * MiB,
        multipart_chunksize=64 * MiB,
        max_concurrency=16,
        io_chunksize=1 * MiB,
        num_download_attempts=3,
        preferred_transfer_client="classic",
    )


def _translate(sdk: SimpleNamespace, e: BaseException, what: str) -> TierckptError:
    bexc = sdk.bexc
    if isinstance(e, bexc.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _MISSING_CODES and what.startswith("get"):
            return NotFoundError(f"{what}: no such object")
        retryable = status >= 500 or status in (408, 429) or code in _RETRYABLE_CODES
        message = redact_text(err.get("Message", ""))  # an SDK message may quote a signed URL
        return BackendError(f"{what}: {code or status} {message}".rstrip(), retryable=retryable)
    retryable = isinstance(e, (
        bexc.ConnectionError,  # refused, connect timeout, DNS, proxy, TLS handshake
        bexc.HTTPClientError,  # read timeout, connection closed, response streaming
        bexc.IncompleteReadError,
        bexc.ChecksumError,
        sdk.sexc.RetriesExceededError,  # s3transfer gave up on a ranged GET's body
    ))
    return BackendError(f"{what}: {redact_text(e)}", retryable=retryable)


def _write_args(sse: str | None, kms_key: str | None, storage_class: str | None) -> dict[str, str]:
    """Request parameters of every PUT (and multipart upload): encryption and storage class."""
    args: dict[str, str] = {}
    if sse:
        args["ServerSideEncryption"] = sse
        if kms_key:
            args["SSEKMSKeyId"] = kms_key
    if storage_class:
        args["StorageClass"] = storage_class
    return args


class S3Backend(Backend):
    """Objects below ``s3://bucket/prefix``.

    Files go through one long-lived s3transfer manager: multipart upload (parts in parallel) above
    ``transfer_config.multipart_threshold``, parallel ranged GETs into a temporary file that is
    renamed at the end for downloads. A failed multipart upload is aborted by s3transfer, so no
    object appears; add a bucket lifecycle rule that aborts incomplete uploads after a day for
    the case where the daemon dies mid-upload.

    Args:
        bucket: Bucket name.
        prefix: Root prefix inside the bucket ("" or ending in ``/``).
        url: The URL to report.
        transfer_config: Overrides :func:`default_transfer_config`.
        sdk_max_attempts: botocore attempts per request ("standard" retry mode), first included;
            small because :mod:`tierckptd.retry` wraps every call.
        connect_timeout: Seconds to establish a connection.
        read_timeout: Seconds without data on a socket before a request fails.
        session: A boto3 Session (default: a new one from the standard environment).
        endpoint_url: Endpoint of an S3-compatible store (default: the environment's or AWS's).
        region: Region name (default: the environment's).
        addressing_style: "auto", "path" or "virtual".
        sse: Server-side encryption of written objects: "AES256", "aws:kms" or None.
        sse_kms_key_id: KMS key for ``sse="aws:kms"`` (None: the account's default key).
        storage_class: Storage class of written objects (None: the bucket's default).

    Attributes:
        transfer_config: The TransferConfig in use (benchmarks compare against plain
            ``client.upload_file(..., Config=transfer_config)``).
        client: The boto3 S3 client.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        transfer_config: TransferConfig | None = None,
        sdk_max_attempts: int = 3,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        session: Any = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str = "auto",
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        storage_class: str | None = None,
    ) -> None:
        self._sdk = sdk = _load_sdk()
        self.bucket = bucket
        self.prefix = prefix
        self.url = redact_url(url) if url else f"s3://{bucket}/{prefix}"
        self.transfer_config = transfer_config or default_transfer_config()
        config = sdk.Config(
            retries={"mode": "standard", "max_attempts": sdk_max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # every part request of every concurrent transfer needs its own pooled connection
            max_pool_connections=max(10, self.transfer_config.max_request_concurrency + 4),
            s3={"addressing_style": addressing_style},
        )
        self.write_args = _write_args(sse, sse_kms_key_id, storage_class)
        self._error_types = (sdk.bexc.ClientError, sdk.bexc.BotoCoreError, sdk.sexc.RetriesExceededError)
        with self._errors("open", ""):
            self.client = (session or sdk.boto3.session.Session()).client(
                "s3", config=config, endpoint_url=endpoint_url, region_name=region)
        self._manager = sdk.create_transfer_manager(self.client, self.transfer_config)

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _errors(self, op: str, key: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors(
            self._error_types, functools.partial(_translate, self._sdk), f"{op} {self.url}{key}"
        )

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.put_file`."""
        name = self._key(key)
        with self._errors("put", key):
            self._manager.upload(os.fspath(path), self.bucket, name, extra_args=dict(self.write_args)).result()

    def put_stream(self, key: str, src: BinaryIO, size: int) -> None:
        """See :meth:`Backend.put_stream`. s3transfer reads ``src`` in order (multipart above the
        threshold; an exception from ``src`` aborts the multipart upload, so nothing is published)."""
        name = self._key(key)
        with self._errors("put", key):
            self._manager.upload(src, self.bucket, name, extra_args=dict(self.write_args)).result()

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """See :meth:`Backend.put_bytes`."""
        name = self._key(key)
        with self._errors("put", key):
            self.client.put_object(Bucket=self.bucket, Key=name, Body=bytes(data), **self.write_args)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.get_file`. s3transfer writes a temporary file and renames it."""
        name = self._key(key)
        with self._errors("get", key):
            self._manager.download(self.bucket, name, os.fspath(path)).result()

    def get_bytes(self, key: str, limit: int | None = None) -> bytes:
        """See :meth:`Backend.get_bytes` (the size is the GET's Content-Length, checked before the
        body is read; a refused body is not read and its connection is closed)."""
        name = self._key(key)
        with self._errors("get", key):
            got = self.client.get_object(Bucket=self.bucket, Key=name)
            with contextlib.closing(got["Body"]) as body:
                check_limit(f"get {self.url}{key}", got.get("ContentLength"), limit)
                data = body.read() if limit is None else body.read(limit + 1)
        check_limit(f"get {self.url}{key}", len(data), limit)
        return data

    def list(self, prefix: str = "") -> list[str]:
        """See :meth:`Backend.list`."""
        full = self.prefix + check_prefix(prefix)
        cut = len(self.prefix)
        keys: list[str] = []
        with self._errors("list", prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            for page in pages:
                keys.extend(obj["Key"][cut:] for obj in page.get("Contents", ()))
        keys.sort()
        return keys

    def delete(self, keys: Sequence[str]) -> None:
        """See :meth:`Backend.delete`. Batches of 1,000 keys per DeleteObjects request."""
        names = [self._key(k) for k in keys]
        for i in range(0, len(names), _DELETE_BATCH):
            batch = names[i : i + _DELETE_BATCH]
            with self._errors("delete", batch[0][len(self.prefix):]):
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True}
                )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise BackendError(
                    f"delete {self.url}: {len(errors)} of {len(batch)} keys failed, first "
                    f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message', '')}".rstrip(),
                    retryable=all(err.get("Code") in _RETRYABLE_CODES for err in errors),
                )

    def exists(self, key: str) -> bool:
        """See :meth:`Backend.exists`."""
        name = self._key(key)
        try:
            with self._errors("get", key):
                self.client.head_object(Bucket=self.bucket, Key=name)
        except NotFoundError:
            return False
        return True

    def close(self) -> None:
        """See :meth:`Backend.close`."""
        self._manager.shutdown()
        self.client.close()
