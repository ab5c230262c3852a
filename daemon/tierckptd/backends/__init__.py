"""Persistent-tier storage backends, chosen by URL scheme.

==========================  ==================================  ==========================
URL                         backend                             needs
==========================  ==================================  ==========================
``file:///abs/dir``         :class:`~.file.FileBackend`         nothing
``s3://bucket[/prefix]``    :class:`~.s3.S3Backend`             ``pip install 'tierckpt[s3]'``
``gs://bucket[/prefix]``    :class:`~.gcs.GcsBackend`           ``pip install 'tierckpt[gcs]'``
==========================  ==================================  ==========================

The cloud modules (and their SDKs) are imported only when such a URL is opened, so the daemon runs
without the SDKs it does not use.
"""

from __future__ import annotations

import importlib
import re
import urllib.parse
from typing import Any

from tierckpt.errors import InvalidArgumentError

from tierckptd.config import ConfigError
from tierckptd.redact import redact_text, redact_url

from .base import Backend, BackendError, MissingExtraError, ObjectTooLargeError, check_key

__all__ = ["Backend", "BackendError", "MissingExtraError", "ObjectTooLargeError", "backend_options", "open_backend",
           "parse_url", "redact_text", "redact_url"]

_FIELD = "persistent"
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,221}[A-Za-z0-9]")
_MODULES = {"s3": ("s3", "S3Backend"), "gs": ("gcs", "GcsBackend")}


def _bad(url: str, why: str) -> ConfigError:
    # The URL is shown redacted: a rejected URL is exactly the one that may carry a secret.
    return ConfigError(f"{_FIELD}: {redact_url(url)!r} {redact_text(why)} "
                       "(expected file:///dir, s3://bucket/prefix or gs://bucket/prefix)")


def parse_url(url: str) -> tuple[str, str, str]:
    """Split a persistent-tier URL into ``(scheme, location, prefix)``.

    For ``file`` the location is the absolute directory and the prefix is empty; for ``s3`` and
    ``gs`` the location is the bucket and the prefix is "" or ends in ``/``.

    Raises:
        ConfigError: The URL is malformed; the message names the ``persistent`` field.
    """
    if not isinstance(url, str) or not url:
        raise _bad(str(url), "is empty")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise _bad(url, "is not a URL") from None
    if parts.query or parts.fragment or parts.username or parts.password:
        raise _bad(url, "must not carry a query, fragment or credentials")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _bad(url, "must name an absolute directory (file:///dir)")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or path.rstrip("/") == "" or "\0" in path:
            raise _bad(url, "must name an absolute directory other than / (file:///dir)")
        return "file", path, ""
    if parts.scheme in _MODULES:
        if not _BUCKET_RE.fullmatch(parts.netloc):
            raise _bad(url, f"has no valid bucket name ({parts.netloc!r})")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                check_key(prefix, _FIELD)
            except InvalidArgumentError:
                raise _bad(url, "has an invalid prefix (empty, '.' or '..' segments)") from None
            prefix += "/"
        return parts.scheme, parts.netloc, prefix
    raise _bad(url, f"has unsupported scheme {parts.scheme!r}")


def backend_options(config: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`open_backend` that the daemon configuration sets for its URL.

    Args:
        config: a :class:`~tierckptd.config.DaemonConfig` (its ``persistent`` and ``s3_*`` keys).
    """
    if not str(config.persistent).startswith("s3://"):
        return {}
    return {"endpoint_url": config.s3_endpoint or None, "region": config.s3_region or None,
            "addressing_style": config.s3_addressing_style, "sse": config.s3_sse or None,
            "sse_kms_key_id": config.s3_sse_kms_key_id or None, "storage_class": config.s3_storage_class or None}


def open_backend(url: str, **opts: Any) -> Backend:
    """Open the backend for ``url``.

    Args:
        url: ``file:///dir``, ``s3://bucket/prefix`` or ``gs://bucket/prefix``.
        **opts: Keyword arguments for the backend class (e.g. ``fsync`` for file,
            ``transfer_config`` for s3, ``chunk_size`` for gs); see each class.

    Returns:
        The backend; call :meth:`Backend.close` when done (or use it as a context manager).

    Raises:
        ConfigError: The URL is malformed; the message names the ``persistent`` field.
        MissingExtraError: The SDK for the scheme is not installed; the message names the extra.
        BackendError: The SDK client could not be created (e.g. no credentials).
    """
    scheme, location, prefix = parse_url(url)
    if scheme == "file":
        from .file import FileBackend

        return FileBackend(location, **opts)
    module, cls = _MODULES[scheme]
    backend_cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    return backend_cls(location, prefix, url=f"{scheme}://{location}/{prefix}", **opts)
