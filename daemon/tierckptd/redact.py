"""Keep secrets out of logs and error messages.

A persistent-tier URL may carry credentials an operator pasted by mistake
(``s3://KEY:SECRET@bucket/prefix``), and an SDK error may quote a signed URL
(``...?X-Amz-Signature=...``, ``?token=...``, a GCS resumable ``upload_id``). Every message that
names such a URL goes through :func:`redact_url` (one URL) or :func:`redact_text` (free text that
may contain URLs). Both keep the scheme, host, bucket and path, which are needed to debug, and
replace the user information, every query value and any fragment with ``***``.

The functions never raise: a string that does not parse as a URL is redacted by pattern.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["MASK", "redact_text", "redact_url"]

MASK = "***"

# scheme://[userinfo@]rest, up to whitespace or a quote/bracket that ends a URL in prose or repr().
_URL_RE = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}]+)")
# A credential-looking key=value outside a URL (e.g. "X-Amz-Credential=..." in an SDK message).
_KV_RE = re.compile(
    r"(?i)\b((?:x-amz-|x-goog-)[a-z0-9-]+|[a-z0-9_-]*(?:token|secret|signature|password|passwd|credential|"
    r"sig|apikey|api_key|access_key|upload_id|session)[a-z0-9_-]*)=([^&\s'\";,]+)")


def _mask_query(query: str) -> str:
    parts = []
    for item in query.split("&"):
        name, eq, _value = item.partition("=")
        parts.append(f"{name}={MASK}" if eq else (MASK if name else ""))
    return "&".join(parts)


def redact_url(url: object) -> str:
    """``url`` with its user information, query values and fragment replaced by ``***``.

    >>> redact_url("s3://AKIA:secret@bucket/ckpt?X-Amz-Signature=abc#x")
    's3://***@bucket/ckpt?X-Amz-Signature=***#***'

    Args:
        url: Anything; it is converted with ``str()``.

    Returns:
        The redacted text; a URL without secrets is returned unchanged.
    """
    text = str(url)
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:  # e.g. an unbalanced "[" in the host: fall back to patterns
        return _redact_by_pattern(text)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rpartition("@")[2]
    query = _mask_query(parts.query) if parts.query else ""
    fragment = MASK if parts.fragment else ""
    out = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, fragment))
    if parts.query and not query.strip("&"):
        out += "?"
    # urlunsplit drops an empty netloc after "scheme:" (file:///dir keeps its three slashes).
    if text.startswith(f"{parts.scheme}://") and not out.startswith(f"{parts.scheme}://"):
        out = out.replace(f"{parts.scheme}:", f"{parts.scheme}://", 1)
    return _redact_by_pattern(out) if out == text else out


def _redact_by_pattern(text: str) -> str:
    text = re.sub(r"(://)[^/@\s]*@", r"\1" + MASK + "@", text)
    return _KV_RE.sub(lambda m: f"{m.group(1)}={MASK}", text)


def redact_text(text: object) -> str:
    """``text`` with every URL in it passed through :func:`redact_url` and credential-looking
    ``name=value`` pairs (``X-Amz-*``, ``*token*``, ``*secret*``, ``*signature*``, ...) masked."""
    out = _URL_RE.sub(lambda m: redact_url(m.group(1)), str(text))
    return _KV_RE.sub(lambda m: f"{m.group(1)}={MASK}", out)
