"""The persistent-tier plug-in point: one small abstract class, :class:`Backend`.

A backend stores opaque objects under string keys below a root (a directory, or a bucket and
prefix). It knows nothing of jobs, steps or manifests: the drain engine decides what to write and
in which order (data first, the manifest last) and a backend only moves bytes.
"""

from __future__ import annotations

import abc
import contextlib
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from tierckpt.errors import InvalidArgumentError, TierckptError

__all__ = [
    "Backend", "BackendError", "MissingExtraError", "ObjectTooLargeError", "check_limit",
    "atomic_local_file", "check_key", "check_prefix", "read_exactly", "translate_errors",
]


class BackendError(TierckptError):
    """An object-store call failed.

    Attributes:
        retryable: True when the same call may succeed later unchanged (throttling, 5xx,
            timeouts, refused or reset connections, a checksum mismatch in transit); False when
            it will not (bad credentials, access denied, missing bucket, other 4xx).
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable

    def __reduce__(self) -> tuple[Callable[[str, bool], BackendError], tuple[str, bool]]:
        # keep ``retryable`` across pickling (process pools): the default would drop the kw-only arg
        return (_rebuild_backend_error, (self.args[0] if self.args else "", self.retryable))


def _rebuild_backend_error(message: str, retryable: bool) -> BackendError:
    return BackendError(message, retryable=retryable)


class ObjectTooLargeError(BackendError):
    """An object is larger than the caller accepts (:meth:`Backend.get_bytes` with ``limit``);
    not retryable: a stored object does not shrink."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)

    def __reduce__(self) -> tuple[Callable[[str], ObjectTooLargeError], tuple[str]]:  # type: ignore[override]
        return (ObjectTooLargeError, (self.args[0] if self.args else "",))


def check_limit(what: str, size: int | None, limit: int | None) -> None:
    """Raise :class:`ObjectTooLargeError` when ``size`` (None: unknown) exceeds ``limit`` (None: any)."""
    if limit is not None and size is not None and size > limit:
        raise ObjectTooLargeError(f"{what}: {size} bytes or more, more than the {limit} accepted (not read)")


class MissingExtraError(TierckptError, ImportError):
    """The cloud SDK a backend needs is not installed; the message names the pip extra."""


_TMP_MARK = ".tierckpt-tmp-"
"""Infix of temporary names; keys may not contain it, and listings skip names that do."""


def check_key(key: object, field: str = "key") -> str:
    """Validate an object key relative to a backend's root.

    A key is a ``/``-separated relative path: not empty, no leading or trailing ``/``, no empty,
    ``.`` or ``..`` segment, no backslash or NUL, at most 1024 bytes of UTF-8.

    Args:
        key: The candidate key.
        field: Name used in the error message.

    Returns:
        The key, unchanged.

    Raises:
        InvalidArgumentError: The key is malformed; the message names ``field``.
    """
    ok = (
        isinstance(key, str)
        and 0 < len(key.encode("utf-8", "surrogatepass")) <= 1024
        and "\\" not in key
        and "\0" not in key
        and _TMP_MARK not in key
        and all(seg not in ("", ".", "..") for seg in key.split("/"))
    )
    if not ok:
        raise InvalidArgumentError(
            f"{field}: {key!r} is not a valid object key (a relative '/'-separated path without "
            "empty, '.' or '..' segments)"
        )
    return key  # type: ignore[return-value]


def check_prefix(prefix: object, field: str = "prefix") -> str:
    """Validate a listing prefix: empty, or a key optionally followed by ``/``."""
    if prefix == "":
        return ""
    if isinstance(prefix, str) and prefix.endswith("/"):
        check_key(prefix[:-1], field)
    else:
        check_key(prefix, field)
    return prefix  # type: ignore[return-value]


@contextlib.contextmanager
def atomic_local_file(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success rename it onto ``path``.

    The temporary file is removed if the body raises, so a failed download never leaves a
    partial file at ``path``. Nothing is fsynced: durability of the result is the caller's
    business (the local tier's commit protocol decides whether to flush).
    """
    final = os.fspath(path)
    head, tail = os.path.split(final)
    tmp = os.path.join(head, f"{tail}{_TMP_MARK}{secrets.token_hex(4)}")
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class Backend(abc.ABC):
    """An object store below a root, used by the persistent tier.

    Call order:

    1. ``open_backend(url, **opts)`` builds the backend (parses the URL, creates the SDK client;
       no object is read or written).
    2. Any number of ``put_file`` / ``put_stream`` / ``put_bytes`` / ``get_file`` / ``get_bytes`` / ``list`` /
       ``delete`` / ``exists`` calls, concurrently from any number of worker threads. Every
       method is blocking; the daemon's drain calls them from worker threads, wrapped in
       :func:`tierckptd.retry.call_with_retry`.
    3. ``close()`` once, after the last call has returned.

    Contract:

    * Keys are relative to the root given in the URL (see :func:`check_key`); ``list`` returns
      them in the same form.
    * A put is atomic: readers see the old object, no object, or the whole new one, never a
      prefix of it. A put replaces an existing object. There is no ordering between puts issued
      concurrently; the caller orders the commit marker (manifest) after the data by waiting.
    * ``get_file`` writes ``path`` only on success (temporary name, then rename).
    * Every method is idempotent, so a retry after an ambiguous failure is safe.

    Errors:

    * :class:`tierckpt.errors.NotFoundError` for a key that does not exist (gets only).
    * :class:`BackendError` for everything the store or the network did wrong, with
      ``retryable`` set.
    * :class:`tierckpt.errors.InvalidArgumentError` for a malformed key.
    * ``OSError`` for a local file that cannot be read (puts) or written (``get_file``).
    """

    url: str
    """The URL the backend was opened with (no credentials ever appear in it)."""

    @abc.abstractmethod
    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Upload the local file ``path`` as ``key``; large files go in concurrent parts.

        Raises:
            BackendError: The upload failed; no partial object is visible at ``key``.
            OSError: ``path`` cannot be read.
        """

    @abc.abstractmethod
    def put_stream(self, key: str, src: BinaryIO, size: int) -> None:
        """Upload ``size`` bytes read from the file object ``src`` (positioned at 0) as ``key``.

        ``src`` is read in order (a backend may seek back to re-send a part). An exception raised
        by ``src.read`` (the drain's verifying reader raises DataLossError on a checksum mismatch)
        aborts the upload and propagates unchanged: no object is published at ``key``.

        Raises:
            BackendError: The upload failed; no partial object is visible at ``key``.
            OSError: ``src`` cannot be read.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` as ``key`` (small objects such as manifests).

        Raises:
            BackendError: The upload failed.
        """

    @abc.abstractmethod
    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download ``key`` into the local file ``path`` (replaced); large objects in parallel ranges.

        Raises:
            NotFoundError: ``key`` does not exist; ``path`` is untouched.
            BackendError: The download failed; ``path`` is untouched.
            OSError: ``path`` cannot be written.
        """

    @abc.abstractmethod
    def get_bytes(self, key: str, limit: int | None = None) -> bytes:
        """Return the whole content of ``key``.

        Args:
            limit: the most bytes the caller accepts (stored bytes are hostile): a larger object is
                refused before its body is read where the store tells its size first (the file
                backend's fstat, S3's GET headers), and the read is bounded to ``limit + 1`` bytes
                everywhere (GCS: a ranged GET).

        Raises:
            NotFoundError: ``key`` does not exist.
            ObjectTooLargeError: the object has more than ``limit`` bytes.
            BackendError: The download failed.
        """

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Return every key that starts with ``prefix``, recursively, sorted.

        ``prefix`` is a plain string prefix (``"job/1"`` matches ``job/1/...`` and ``job/10/...``);
        end it with ``/`` to list one "directory".

        Raises:
            BackendError: The listing failed.
        """

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys``; keys that do not exist are ignored.

        Raises:
            BackendError: Some key could not be deleted (the others may be gone).
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Return whether ``key`` exists.

        Raises:
            BackendError: The store could not be asked.
        """

    def remove_stale_temporaries(self, older_than: float) -> int:
        """Remove temporary objects that a killed writer left, older than ``older_than`` seconds;
        return how many. Default: none to remove (object stores publish a put atomically and
        expire abandoned multipart uploads by a bucket lifecycle rule)."""
        return 0

    def close(self) -> None:
        """Release clients, pools and threads. The backend is unusable afterwards."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def read_exactly(src: BinaryIO, size: int, chunk: int = 16 << 20) -> Iterator[bytes]:
    """Yield the first ``size`` bytes of ``src`` in pieces; OSError if it ends early."""
    left = size
    while left > 0:
        data = src.read(min(chunk, left))
        if not data:
            raise OSError(f"stream ended {left} bytes short of {size}")
        left -= len(data)
        yield data


@contextlib.contextmanager
def translate_errors(
    types: tuple[type[BaseException], ...],
    translate: Callable[[BaseException, str], TierckptError],
    what: str,
) -> Iterator[None]:
    """Re-raise the SDK errors listed in ``types`` as tierckpt errors (``raise ... from e``).

    Args:
        types: The SDK exception classes to translate; anything else propagates unchanged.
        translate: Maps ``(error, what)`` to a :class:`NotFoundError` or :class:`BackendError`.
        what: Describes the operation for the message, e.g. ``"get s3://bucket/prefix/key"``.
    """
    try:
        yield
    except types as e:
        raise translate(e, what) from e
