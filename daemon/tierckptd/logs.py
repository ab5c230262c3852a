"""Logging set-up for the daemon: one handler on the ``tierckptd`` logger, plain or JSON lines.

Library modules only call ``logging.getLogger(__name__)``; ``main()`` calls :func:`setup_logging`
once. Structured fields go in ``extra`` and reach both formats::

    log.info("committed %s step %d", job, step, extra={"job": job, "step": step, "bytes": n})
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

__all__ = ["setup_logging", "JsonFormatter", "PlainFormatter"]

LOGGER_NAME = "tierckptd"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Attributes every LogRecord has; anything else on a record came from ``extra``.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")}


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + ".%03dZ" % (created % 1 * 1000)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, RFC 3339), ``level``, ``logger``, ``msg``, ``exc``
    when there is an exception, then every ``extra`` field (non-JSON values via ``str``)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        for key, value in _extras(record).items():
            doc.setdefault(key, value)
        return json.dumps(doc, default=str, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """``2024-05-01T12:00:00.123Z INFO tierckptd.server: message key=value ...`` (UTC)."""

    def format(self, record: logging.LogRecord) -> str:
        line = "%s %s %s: %s" % (_timestamp(record.created), record.levelname, record.name, record.getMessage())
        extras = _extras(record)
        if extras:
            line += " " + " ".join("%s=%s" % (k, json.dumps(v, default=str)) for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def setup_logging(level: str = "INFO", fmt: str = "plain", stream: IO[str] | None = None) -> logging.Logger:
    """Configure the ``tierckptd`` logger; calling it again replaces the previous configuration.

    The root logger is left alone (no ``basicConfig``) and records do not propagate to it, so a
    host application's handlers never print them twice.

    Args:
        level: DEBUG, INFO, WARNING or ERROR (any case).
        fmt: "plain" or "json".
        stream: Where lines go; default ``sys.stderr`` (the journal under systemd, the container log
            under Kubernetes).

    Returns:
        The configured ``tierckptd`` logger.

    Raises:
        ValueError: Unknown level or format.
    """
    if level.upper() not in _LEVELS:
        raise ValueError("log level %r must be one of %s" % (level, ", ".join(_LEVELS)))
    if fmt not in ("plain", "json"):
        raise ValueError("log format %r must be plain or json" % (fmt,))
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if getattr(h, "_tierckptd", False)]:
        logger.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    handler._tierckptd = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger
