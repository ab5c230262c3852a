"""Metrics (every known series at zero, process and GC collectors, tier_up) and logs (every
logger through the configured formatter; in JSON mode stdout and stderr carry only JSON)."""

from __future__ import annotations

import io
import json
import logging
import warnings

import pytest
from tierckptd.logs import THIRD_PARTY, parse_ready_line, ready_line, setup_logging
from tierckptd.metrics import Metrics

from ..harness import Cluster
from ..metrics_scrape import scrape as _values


def test_process_platform_and_gc_collectors() -> None:
    text = Metrics().render().decode()
    for name in ("process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total",
                 "python_info", "python_gc_collections_total", "tierckpt_build_info"):
        assert f"\n{name}" in text, name
    assert Metrics().render()  # a second registry: collectors are per registry, no duplicate error


def test_daemon_exports_tier_up_and_per_peer_series_at_zero(daemon_factory) -> None:
    cluster = Cluster(daemon_factory, 2, metrics=True)
    v = _values(cluster.d["n0"].info["metrics_port"])
    assert v['tierckpt_tier_up{tier="local"}'] == 1 and v['tierckpt_tier_up{tier="peer"}'] == 1
    assert 'tierckpt_tier_up{tier="persistent"}' not in v  # not configured: no series to alert on
    assert v['tierckpt_replication_failures_total{peer="n1"}'] == 0
    assert v['tierckpt_peer_calls_total{peer="n1"}'] >= 0
    assert v['tierckpt_checksum_failures_total{tier="peer"}'] == 0
    assert v["process_resident_memory_bytes"] > 0


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    names = (*THIRD_PARTY, "tierckptd")
    saved = (root.level, {n: (logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names})
    yield
    for h in [h for h in root.handlers if getattr(h, "_tierckptd", False)]:
        root.removeHandler(h)
    root.setLevel(saved[0])
    for name, (level, propagate) in saved[1].items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).propagate = propagate
    logging.captureWarnings(False)


def test_every_logger_goes_through_the_json_formatter(restore_logging) -> None:
    logging.getLogger("google").propagate = False  # what google-api-core does when imported first
    out = io.StringIO()
    setup_logging("INFO", "json", stream=out)
    logging.getLogger("tierckptd.server").info("ours %d", 1, extra={"job": "j"})
    logging.getLogger("botocore.credentials").warning("found credentials in environment variables")
    logging.getLogger("botocore.credentials").info("chatty SDK line")  # held at WARNING
    logging.getLogger("google.auth").error("no application default credentials")
    logging.getLogger("grpc._cython.cygrpc").warning("channel trouble")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [d["logger"] for d in docs] == ["tierckptd.server", "botocore.credentials", "google.auth",
                                           "grpc._cython.cygrpc", "py.warnings"]
    assert docs[0]["job"] == "j" and all({"ts", "level", "msg"} <= d.keys() for d in docs)


def test_plain_format_names_third_party_loggers(restore_logging) -> None:
    out = io.StringIO()
    setup_logging("DEBUG", "plain", stream=out)
    logging.getLogger("s3transfer.tasks").debug("hidden: SDK debug output carries request signatures")
    logging.getLogger("s3transfer.tasks").info("shown at DEBUG")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and " INFO s3transfer.tasks: shown at DEBUG" in lines[0]


def test_ready_line_formats() -> None:
    info = {"node_id": "n0", "tcp_port": 1, "socket": "/s", "metrics_port": None, "pid": 2, "local_dir": "/d"}
    assert ready_line(info).startswith("READY ") and parse_ready_line(ready_line(info)) == info
    doc = json.loads(ready_line(info, "json"))
    assert doc["msg"] == "ready" and doc["event"] == "ready" and doc["level"] == "INFO" and doc["ready"] == info
    assert parse_ready_line(ready_line(info, "json")) == info
    assert parse_ready_line('{"msg": "other"}') is None and parse_ready_line("hello") is None


def test_json_mode_daemon_writes_only_json(daemon_factory) -> None:
    d = daemon_factory("n0", args=("--log-format", "json"))
    with d.client() as c:
        c.save("job", 1, 0, 1, {"x": b"abcd"}).result(30)
    assert d.terminate() == 0
    rest = d.proc.stdout.read().decode()  # after the READY record
    assert all(json.loads(line) for line in rest.splitlines())
    lines = d.log_path.read_text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    assert any(json.loads(line)["msg"].startswith("tierckptd n0 ready") for line in lines)
