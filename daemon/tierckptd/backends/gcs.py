"""``gs://bucket/prefix``: Google Cloud Storage via google-cloud-storage.

Credentials come from Application Default Credentials, which the SDK finds itself
(``GOOGLE_APPLICATION_CREDENTIALS``, gcloud, the metadata server). When ``STORAGE_EMULATOR_HOST``
is set, the SDK talks to that emulator (e.g. fake-gcs-server) with anonymous credentials and a
placeholder project. This module never reads ``os.environ``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, BinaryIO

from tierckpt.errors import NotFoundError, TierckptError

from ..redact import redact_text, redact_url
from .base import (
    Backend,
    BackendError,
    MissingExtraError,
    atomic_local_file,
    check_key,
    check_limit,
    check_prefix,
    translate_errors,
)

__all__ = ["GcsBackend"]

MiB = 1 << 20
_RETRYABLE_STATUS = frozenset({408, 429})


def _load_sdk() -> SimpleNamespace:
    """Import google-cloud-storage now (not when tierckptd is imported), or say what to install."""
    try:
        import requests.exceptions
        from google.api_core import exceptions as gexc
        from google.auth import exceptions as aexc
        from google.cloud import storage
        from google.cloud.storage import transfer_manager
        from google.cloud.storage.retry import DEFAULT_RETRY
    except ImportError as e:
        raise MissingExtraError(
            f"persistent: gs:// needs google-cloud-storage, which cannot be imported ({e}); "
            "install it with: pip install 'tierckpt[gcs]'"
        ) from e
    try:  # google-cloud-storage >= 3
        from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
    except ImportError:  # pragma: no cover - 2.x keeps them in google-resumable-media
        from google.resumable_media.common import DataCorruption, InvalidResponse
    return SimpleNamespace(
        storage=storage, transfer_manager=transfer_manager, DEFAULT_RETRY=DEFAULT_RETRY, gexc=gexc, aexc=aexc,
        rexc=requests.exceptions, DataCorruption=DataCorruption, InvalidResponse=InvalidResponse,
    )


def _retryable_status(code: int | None) -> bool:
    return bool(code) and (code in _RETRYABLE_STATUS or code >= 500)  # type: ignore[operator]


def _translate(sdk: SimpleNamespace, e: BaseException, what: str) -> TierckptError:
    gexc, aexc, rexc = sdk.gexc, sdk.aexc, sdk.rexc
    if isinstance(e, gexc.NotFound):
        if what.startswith("get"):
            return NotFoundError(f"{what}: no such object")
        return BackendError(f"{what}: bucket not found ({redact_text(e.message)})", retryable=False)
    if isinstance(e, gexc.GoogleAPICallError):
        retryable = _retryable_status(e.code)
    elif isinstance(e, sdk.InvalidResponse):
        retryable = _retryable_status(getattr(e.response, "status_code", None))
    elif isinstance(e, aexc.GoogleAuthError):
        retryable = isinstance(e, aexc.TransportError)  # metadata server unreachable; bad creds are final
    elif isinstance(e, rexc.RequestException):
        retryable = isinstance(e, (rexc.ConnectionError, rexc.Timeout, rexc.ChunkedEncodingError))
    else:  # RetryError (the SDK's own retries ran out), DataCorruption, ConnectionError, TimeoutError
        retryable = True
    return BackendError(f"{what}: {type(e).__name__}: {redact_text(e)}", retryable=retryable)  # no signed URLs


class GcsBackend(Backend):
    """Objects below ``gs://bucket/prefix``.

    Uploads are resumable uploads in ``chunk_size`` pieces (a lost connection resumes from the
    last acknowledged chunk within the SDK's retry window; the object appears only when the last
    chunk is committed). Downloads above ``download_chunk_size`` use
    ``transfer_manager.download_chunks_concurrently`` with threads: parallel ranged GETs pinned to
    the object's generation, crc32c checked over the whole object.

    Args:
        bucket: Bucket name.
        prefix: Root prefix inside the bucket ("" or ending in ``/``).
        url: The URL to report.
        chunk_size: Resumable upload chunk, a multiple of 256 KiB.
        download_chunk_size: Bytes per ranged GET; smaller objects are fetched in one request.
        download_workers: Parallel ranged GETs per download.
        timeout: ``(connect, read)`` seconds per HTTP request.
        sdk_retry_timeout: Seconds the SDK itself retries transient errors of one call (0: no SDK
            retries); small because :mod:`tierckptd.retry` wraps every call.
        project: Project for the client (objects need none; default: no project).
        client: A ``google.cloud.storage.Client`` to use instead of creating one.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        chunk_size: int = 64 * MiB,
        download_chunk_size: int = 64 * MiB,
        download_workers: int = 8,
        timeout: tuple[float, float] = (10.0, 120.0),
        sdk_retry_timeout: float = 15.0,
        project: str | None = None,
        client: Any = None,
    ) -> None:
        if chunk_size <= 0 or chunk_size % (256 * 1024):
            raise ValueError("chunk_size must be a positive multiple of 256 KiB")
        self._sdk = sdk = _load_sdk()
        self.bucket = bucket
        self.prefix = prefix
        self.url = redact_url(url) if url else f"gs://{bucket}/{prefix}"
        self._chunk_size = chunk_size
        self._download_chunk_size = download_chunk_size
        self._download_workers = download_workers
        self._timeout = timeout
        self._retry = sdk.DEFAULT_RETRY.with_timeout(sdk_retry_timeout) if sdk_retry_timeout > 0 else None
        self._error_types = (
            sdk.gexc.GoogleAPIError, sdk.aexc.GoogleAuthError, sdk.rexc.RequestException,
            sdk.DataCorruption, sdk.InvalidResponse, ConnectionError, TimeoutError,
        )
        self._owns_client = client is None
        with self._errors("open", ""):
            self.client = client if client is not None else sdk.storage.Client(project=project)
        self._bucket = self.client.bucket(bucket)
        self._kw = {"timeout": self._timeout, "retry": self._retry}

    def _errors(self, op: str, key: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors(self._error_types, functools.partial(_translate, self._sdk), f"{op} {self.url}{key}")

    def _blob(self, key: str, *, upload: bool = False) -> Any:
        # chunk_size only for uploads: on a download it would turn one GET into ranged GETs,
        # and a ranged GET of an empty object is refused with 416.
        return self._bucket.blob(self.prefix + check_key(key), chunk_size=self._chunk_size if upload else None)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.put_file`."""
        blob = self._blob(key, upload=True)
        with self._errors("put", key):
            blob.upload_from_filename(os.fspath(path), content_type="application/octet-stream", **self._kw)

    def put_stream(self, key: str, src: BinaryIO, size: int) -> None:
        """See :meth:`Backend.put_stream`."""
        blob = self._blob(key, upload=True)
        with self._errors("put", key):
            blob.upload_from_file(src, size=size, content_type="application/octet-stream", **self._kw)

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """See :meth:`Backend.put_bytes`."""
        blob = self._blob(key, upload=True)
        with self._errors("put", key):
            blob.upload_from_string(bytes(data), content_type="application/octet-stream", **self._kw)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """See :meth:`Backend.get_file`."""
        name = self.prefix + check_key(key)
        with self._errors("get", key):
            blob = self._bucket.get_blob(name, **self._kw)  # size and generation, pinned below
            if blob is None:
                raise NotFoundError(f"get {self.url}{key}: no such object")
            with atomic_local_file(path) as tmp:
                if (blob.size or 0) <= self._download_chunk_size:
                    blob.download_to_filename(tmp, **self._kw)
                else:
                    self._sdk.transfer_manager.download_chunks_concurrently(
                        blob, tmp, chunk_size=self._download_chunk_size, download_kwargs=dict(self._kw),
                        worker_type=self._sdk.transfer_manager.THREAD, max_workers=self._download_workers,
                    )

    def get_bytes(self, key: str, limit: int | None = None) -> bytes:
        """See :meth:`Backend.get_bytes` (with ``limit``: a ranged GET of ``limit + 1`` bytes)."""
        blob = self._blob(key)
        with self._errors("get", key):
            data = blob.download_as_bytes(**self._kw) if limit is None else blob.download_as_bytes(
                start=0, end=limit, **self._kw)
        check_limit(f"get {self.url}{key}", len(data), limit)
        return data

    def list(self, prefix: str = "") -> list[str]:
        """See :meth:`Backend.list`."""
        full = self.prefix + check_prefix(prefix)
        cut = len(self.prefix)
        with self._errors("list", prefix):
            keys = [b.name[cut:] for b in self.client.list_blobs(self._bucket, prefix=full, **self._kw)]
        keys.sort()
        return keys

    def delete(self, keys: Sequence[str]) -> None:
        """See :meth:`Backend.delete`. Up to ``download_workers`` deletes run at once."""
        blobs = [self._blob(k) for k in keys]
        if not blobs:
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(blobs), self._download_workers)) as pool:
            for _ in pool.map(self._delete_one, blobs):
                pass

    def _delete_one(self, blob: Any) -> None:
        with self._errors("delete", blob.name[len(self.prefix):]):
            try:
                blob.delete(**self._kw)
            except self._sdk.gexc.NotFound:
                pass

    def exists(self, key: str) -> bool:
        """See :meth:`Backend.exists`."""
        blob = self._blob(key)
        with self._errors("get", key):
            return bool(blob.exists(**self._kw))

    def close(self) -> None:
        """See :meth:`Backend.close`."""
        if self._owns_client:
            self.client.close()
