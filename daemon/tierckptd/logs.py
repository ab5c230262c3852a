"""Logging set-up for the daemon: one handler on the root logger, plain or JSON lines.

Library modules only call ``logging.getLogger(__name__)``; ``main()`` calls :func:`setup_logging`
once. Structured fields go in ``extra`` and reach both formats::

    log.info("committed %s step %d", job, step, extra={"job": job, "step": step, "bytes": n})

Every logger of the process goes through the one formatter: the daemon's own (``tierckptd.*``)
and third-party ones (botocore, s3transfer, urllib3, google, grpc), which propagate to the root
handler; Python warnings are captured too. Third-party loggers are held at WARNING (INFO when
the daemon logs at DEBUG: SDK debug output carries request signatures).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

__all__ = ["setup_logging", "ready_line", "parse_ready_line", "JsonFormatter", "PlainFormatter", "THIRD_PARTY"]

LOGGER_NAME = "tierckptd"
THIRD_PARTY = ("botocore", "boto3", "s3transfer", "urllib3", "google", "grpc", "asyncio", "py.warnings")
"""Loggers of libraries the daemon uses; they keep their own names in every line."""
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
    """Configure the process's logging for the daemon; calling it again replaces the previous set-up.

    One handler on the root logger, so that every logger (the daemon's and third-party ones)
    writes through the same formatter. Only ``tierckptd.main`` calls this (no ``basicConfig``
    in library code).

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
    root = logging.getLogger()
    logger = logging.getLogger(LOGGER_NAME)
    for owner in (root, logger):
        for old in [h for h in owner.handlers if getattr(h, "_tierckptd", False)]:
            owner.removeHandler(old)
            old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    handler._tierckptd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    logger.setLevel(level.upper())
    logger.propagate = True
    floor = logging.INFO if level.upper() == "DEBUG" else logging.WARNING
    for name in THIRD_PARTY:
        # A level set here also counts as "configured" for google-api-core, which otherwise turns
        # off propagation of the "google" logger when it is first imported.
        third = logging.getLogger(name)
        third.setLevel(floor)
        third.propagate = True
    logging.captureWarnings(True)
    return logger


def ready_line(info: dict[str, Any], fmt: str = "plain") -> str:
    """The start-up line on stdout that says the daemon serves, with its ports.

    Plain: ``READY {json}``. JSON: a log record of the JSON format (``msg`` "ready",
    ``event`` "ready", the fields under ``ready``), so that a log shipper reading stdout sees
    only JSON; :class:`tierckptd.testing.Daemon` reads either.
    """
    if fmt != "json":
        return "READY " + json.dumps(info)
    record = logging.getLogger(LOGGER_NAME).makeRecord(
        LOGGER_NAME, logging.INFO, __file__, 0, "ready", (), None, extra={"event": "ready", "ready": info})
    return JsonFormatter().format(record)


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The ``info`` of a line written by :func:`ready_line` (either format), else None."""
    if line.startswith("READY "):
        return json.loads(line[6:])
    if line.startswith("{"):
        try:
            doc = json.loads(line)
        except ValueError:
            return None
        if isinstance(doc, dict) and doc.get("event") == "ready" and isinstance(doc.get("ready"), dict):
            return doc["ready"]
    return None
