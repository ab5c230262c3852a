"""Structure of deploy/: systemd unit and config, Kubernetes manifests, Grafana dashboard.

Every flag and config key used in deploy/ must be one the daemon accepts, and the effective
configuration of each deployment must pass ``load_config`` and serve the network only with mTLS.
External validators (systemd-analyze, kubeconform, kubernetes-validate) run when installed and
are skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tierckptd.config import ConfigError, DaemonConfig, build_parser, load_config
from tierckptd.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "tierckptd.service"
KEYS = {f.name for f in dataclasses.fields(DaemonConfig)}
POD_ENV = {"NODE_NAME": "gpu-node-7", "POD_IP": "10.1.2.3", "POD_NAMESPACE": "tierckpt"}
_QUANTITY = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _quantity(text: str) -> int:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    assert m and m.group(2) in _QUANTITY, text
    return int(m.group(1)) * _QUANTITY[m.group(2)]


# Kinds that appear more than once are keyed "Kind/name" (cert-manager: the CA and the node certificate).
_MULTI = {"Certificate"}


def _manifests() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = "%s/%s" % (doc["kind"], doc["metadata"]["name"]) if doc["kind"] in _MULTI else doc["kind"]
                assert key not in docs, "two %s documents" % key
                docs[key] = doc
    return docs


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    return _manifests()


def _daemon_container(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (c,) = [c for c in k8s["DaemonSet"]["spec"]["template"]["spec"]["containers"] if c["name"] == "tierckptd"]
    return c


def _configmap_toml(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return tomllib.loads(k8s["ConfigMap"]["data"]["tierckptd.toml"])


def _parse_flags(argv: list[str]) -> dict[str, Any]:
    """Check every --flag against tierckptd's parser and return the overrides it yields."""
    parser = build_parser()
    known = set(parser._option_string_actions)
    for arg in argv:
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in known, "tierckptd has no flag %s" % arg
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse reports usage errors by exiting
        raise AssertionError("tierckptd rejects %r" % (argv,)) from e
    return {k: v for k, v in vars(ns).items() if v is not None}


def _expand(arg: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, "$(%s) is not in the container's env" % m.group(1)
        return POD_ENV[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


# --- Kubernetes -----------------------------------------------------------------------------------

def test_every_manifest_parses_and_kustomization_lists_it(k8s: dict[str, dict[str, Any]]) -> None:
    assert {"Namespace", "ConfigMap", "Service", "DaemonSet", "ServiceMonitor", "Kustomization", "ClusterIssuer",
            "Issuer", "Certificate/tierckpt-ca", "Certificate/tierckptd-tls", "PriorityClass",
            "PodDisruptionBudget", "PrometheusRule"} <= set(k8s)
    for doc in k8s.values():
        assert doc.get("apiVersion") and doc.get("kind"), doc
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert kust["namespace"] == k8s["Namespace"]["metadata"]["name"]
    assert k8s["ServiceMonitor"]["apiVersion"] == "monitoring.coreos.com/v1"


def test_daemonset_selector_matches_template(k8s: dict[str, dict[str, Any]]) -> None:
    spec = k8s["DaemonSet"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert not spec["selector"].get("matchExpressions")


def test_daemonset_args_are_valid_flags_and_config(k8s: dict[str, dict[str, Any]]) -> None:
    c = _daemon_container(k8s)
    assert c["command"] == ["tierckptd"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    argv = [_expand(a, env) for a in c["args"]]
    overrides = _parse_flags(argv)
    assert overrides["node_id"] == POD_ENV["NODE_NAME"]
    config_path = overrides.pop("config")
    # The effective configuration of a pod: the ConfigMap's TOML plus the flags.
    cfg = load_config(_configmap_toml(k8s), overrides)
    service = k8s["Service"]
    ns = k8s["Namespace"]["metadata"]["name"]
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert cfg.peers_dns == "%s.%s.svc.cluster.local:%d" % (service["metadata"]["name"], ns, grpc_port)
    assert int(cfg.listen.rpartition(":")[2]) == grpc_port
    # --config names the ConfigMap's key through a mounted configMap volume.
    volumes = {v["name"]: v for v in k8s["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    mount = mounts[str(Path(config_path).parent)]
    assert volumes[mount["name"]]["configMap"]["name"] == k8s["ConfigMap"]["metadata"]["name"]
    assert Path(config_path).name in k8s["ConfigMap"]["data"]


def _probe_paths(k8s: dict[str, dict[str, Any]]) -> dict[str, str]:
    """probe -> the HTTP path it asks on the metrics port."""
    c = _daemon_container(k8s)
    out = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(c[probe]) & {"exec", "grpc", "tcpSocket"} == set(), probe  # no interpreter per probe
        assert c[probe]["httpGet"]["port"] == "metrics", probe
        out[probe] = c[probe]["httpGet"]["path"]
    return out


def test_probes_and_ports(k8s: dict[str, dict[str, Any]]) -> None:
    c = _daemon_container(k8s)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    cfg = load_config(_configmap_toml(k8s))
    assert ports["metrics"] == cfg.metrics_port
    # The TCP port requires a client certificate, which the kubelet's gRPC probe cannot present:
    # the probes ask the HTTP health endpoints of the metrics port instead.
    assert _probe_paths(k8s) == {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["timeoutSeconds"] >= 5, probe
    svc = k8s["Service"]["spec"]
    for p in svc["ports"]:
        assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"], p


def test_volumes_socket_and_local_tier(k8s: dict[str, dict[str, Any]]) -> None:
    pod = k8s["DaemonSet"]["spec"]["template"]["spec"]
    c = _daemon_container(k8s)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for ctr in pod["containers"] + pod.get("initContainers", []):
        for m in ctr.get("volumeMounts", []):
            assert m["name"] in volumes, m
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    cfg = load_config(_configmap_toml(k8s))
    sock_dir = str(Path(cfg.socket).parent)
    assert sock_dir == "/run/tierckpt"
    assert volumes[mounts[sock_dir]]["hostPath"]["path"] == "/run/tierckpt"
    local_mount = next(p for p in mounts if cfg.local_dir == p or cfg.local_dir.startswith(p + "/"))
    local = volumes[mounts[local_mount]]
    # The fast path: the local tier is a hostPath on the node's RAM disk that trainer pods mount too.
    assert local["hostPath"]["path"] == "/dev/shm/tierckpt" and "emptyDir" not in local
    # Replicas the daemon writes are tmpfs pages charged to it: the limit covers a full local tier.
    assert 0 < cfg.local_capacity <= _quantity(c["resources"]["limits"]["memory"])
    # The init container hands both directories to the daemon and the trainers' group.
    (init,) = pod["initContainers"]
    script = init["command"][-1]
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    assert init_mounts[local_mount] == mounts[local_mount] and init_mounts[sock_dir] == mounts[sock_dir]
    uid, gid = pod["securityContext"]["runAsUser"], cfg.socket_group
    assert f"chown {uid}:{gid} {sock_dir} {local_mount}" in script
    assert "FSETID" in init["securityContext"]["capabilities"]["add"]  # keeps the setgid bit
    # The local root is setgid (group 2000 below it) and not writable by the trainers' group, so a
    # trainer cannot rename jobs/ or plant entries under the daemon (no sticky bit needed).
    (mode,) = re.findall(r"chmod (\d{4}) " + re.escape(local_mount) + r"\b", script)
    assert int(mode, 8) & 0o7777 == 0o2750, mode
    assert not re.search(r"chmod (-R )?\S*\b" + re.escape(local_mount) + r"/", script)  # nothing below it


def test_grace_period_covers_shutdown_timeout(k8s: dict[str, dict[str, Any]]) -> None:
    cfg = load_config(_configmap_toml(k8s))
    assert k8s["DaemonSet"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > cfg.shutdown_timeout


def test_headless_service_and_servicemonitor(k8s: dict[str, dict[str, Any]]) -> None:
    svc = k8s["Service"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    pod_labels = k8s["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    sm = k8s["ServiceMonitor"]["spec"]
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["endpoints"] and all(e["port"] in svc_ports for e in sm["endpoints"])


def test_kubeconform_when_available() -> None:
    exe = shutil.which("kubeconform")
    if exe is None:
        pytest.skip("kubeconform not installed")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    proc = subprocess.run([exe, "-strict", "-summary", "-ignore-missing-schemas", *files],
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and re.search(r"dial tcp|no such host|failed downloading|timeout", out):
        pytest.skip("kubeconform cannot fetch schemas: %s" % out.strip()[:200])
    assert proc.returncode == 0, out


@pytest.mark.slow
def test_probes_ask_a_real_daemon(k8s: dict[str, dict[str, Any]], daemon_factory) -> None:
    """The probes' paths on a real daemon's metrics port: 200 while it serves; /metrics unchanged."""
    import urllib.request

    from tierckptd.testing import free_port

    port = free_port()
    d = daemon_factory("probe", args=("--metrics-port", str(port)))
    for path in set(_probe_paths(k8s).values()):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            assert r.status == 200 and r.read() in (b"ready\n", b"alive\n"), path
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert b"tierckpt_local_used_bytes" in r.read()
    d.kill()


def test_daemonset_serves_mtls_from_the_cert_manager_secret(k8s: dict[str, dict[str, Any]]) -> None:
    c = _daemon_container(k8s)
    env = {e["name"]: e for e in c["env"]}
    overrides = _parse_flags([_expand(a, env) for a in c["args"]])
    overrides.pop("config")
    cfg = load_config(_configmap_toml(k8s), overrides)  # a pod IP listener passes only with mTLS
    assert cfg.tls_enabled and not cfg.insecure_listen and cfg.listen.startswith(POD_ENV["POD_IP"] + ":")
    assert load_config(_configmap_toml(k8s)).tls_enabled  # the ConfigMap alone is on too
    pod = k8s["DaemonSet"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    cert = k8s["Certificate/tierckptd-tls"]
    tls_dir = str(Path(cfg.tls_cert).parent)
    assert {str(Path(p).parent) for p in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)} == {tls_dir}
    mount = mounts[tls_dir]
    assert mount.get("readOnly") and "subPath" not in mount  # subPath mounts are never updated on renewal
    assert volumes[mount["name"]]["secret"]["secretName"] == cert["spec"]["secretName"]
    # cert-manager's Secret keys
    assert [Path(p).name for p in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)] == ["tls.crt", "tls.key", "ca.crt"]
    # Secret files are group-readable for fsGroup: accepted only because that group is not the trainers'.
    assert cfg.tls_key_group_readable and str(pod["securityContext"]["fsGroup"]) != cfg.socket_group
    assert pod["securityContext"]["runAsGroup"] == pod["securityContext"]["fsGroup"]
    # One shared certificate: it cannot bind node ids (SECURITY.md), and it names what peers dial.
    assert cfg.tls_bind_node_id is False
    peers_host = cfg.peers_dns.rpartition(":")[0]
    assert peers_host in cert["spec"]["dnsNames"]


def test_cert_manager_chain(k8s: dict[str, dict[str, Any]]) -> None:
    root, ca, issuer, node = (k8s["ClusterIssuer"], k8s["Certificate/tierckpt-ca"], k8s["Issuer"],
                              k8s["Certificate/tierckptd-tls"])
    for doc in (root, ca, issuer, node):
        assert doc["apiVersion"] == "cert-manager.io/v1", doc["kind"]
    assert root["spec"] == {"selfSigned": {}}
    assert ca["spec"]["isCA"] is True
    assert ca["spec"]["issuerRef"] == {"name": root["metadata"]["name"], "kind": "ClusterIssuer",
                                       "group": "cert-manager.io"}
    assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    assert node["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                         "group": "cert-manager.io"}
    assert not node["spec"].get("isCA")
    assert {"server auth", "client auth"} <= set(node["spec"]["usages"])
    assert node["spec"]["privateKey"]["algorithm"] == "ECDSA"
    ns = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert all(".%s" % ns in n for n in node["spec"]["dnsNames"])


_CRD_GROUPS = ("cert-manager.io", "monitoring.coreos.com")


def _rendered() -> list[dict[str, Any]]:
    """The manifests as applied: ``kubectl kustomize`` output when kubectl is here, else the files."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        proc = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]
    return [d for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def test_kustomize_renders_every_resource_in_the_namespace() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    docs = _rendered()
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "PriorityClass", "PodDisruptionBudget", "PrometheusRule", "ServiceMonitor"} <= kinds
    cluster_scoped = {"Namespace", "PriorityClass", "ClusterIssuer"}
    for d in docs:
        if d["kind"] not in cluster_scoped:
            assert d["metadata"].get("namespace") == "tierckpt", d["kind"]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    assert images == {"registry.example.com/tierckpt:0.1.0"}


def test_kubernetes_validate() -> None:
    kv = kubernetes_validate
    version = kv.latest_version() if hasattr(kv, "latest_version") else "1.30.0"
    docs = _rendered() + list(yaml.safe_load_all((K8S / "examples" / "trainer-job.yaml").read_text()))
    checked = set()
    for doc in docs:
        if not doc or doc["apiVersion"].split("/")[0] in _CRD_GROUPS:  # CRDs: no schema here
            continue
        kv.validate(doc, version, strict=True)
        checked.add(doc["kind"])
    assert {"DaemonSet", "PriorityClass", "PodDisruptionBudget", "Job", "ConfigMap", "Service"} <= checked


def test_priority_class_and_disruption_budget(k8s: dict[str, dict[str, Any]]) -> None:
    pod = k8s["DaemonSet"]["spec"]["template"]
    assert pod["spec"]["priorityClassName"] == k8s["PriorityClass"]["metadata"]["name"]
    assert k8s["PriorityClass"]["value"] >= 1_000_000 and k8s["PriorityClass"]["globalDefault"] is False
    pdb = k8s["PodDisruptionBudget"]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_trainer_job_uses_the_fast_path(k8s: dict[str, dict[str, Any]]) -> None:
    job = yaml.safe_load((K8S / "examples" / "trainer-job.yaml").read_text())
    assert job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cfg = load_config(_configmap_toml(k8s))
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TIERCKPT_ADDRESS"] == "unix://" + cfg.socket
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    ds_pod = k8s["DaemonSet"]["spec"]["template"]["spec"]
    ds_volumes = {v["name"]: v for v in ds_pod["volumes"]}
    ds_mounts = {m["mountPath"]: ds_volumes[m["name"]] for m in _daemon_container(k8s)["volumeMounts"]}
    # the same host directories at the same paths as in the daemon's pod (the daemon names files by path)
    for path in (str(Path(cfg.socket).parent), cfg.local_dir):
        assert mounts[path]["hostPath"]["path"] == ds_mounts[path]["hostPath"]["path"], path
    sc = pod["securityContext"]
    assert int(cfg.socket_group) in sc["supplementalGroups"] or sc["runAsGroup"] == int(cfg.socket_group)
    # staging files are 0660 for the socket group: any uid of the group may write them, not root
    assert sc["runAsUser"] != 0 and sc.get("runAsNonRoot") is True
    assert {t["key"] for t in pod["tolerations"]} >= {t["key"] for t in ds_pod["tolerations"]}


def test_prometheus_rules_use_exported_metrics(k8s: dict[str, dict[str, Any]]) -> None:
    rule = k8s["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    for want in ("DrainBacklog", "ReplicationFailing", "LocalTier", "Checksum", "PeerDown", "Degraded",
                 "UndrainedEviction", "SavesFailing"):
        assert any(want in n for n in names), want
    by_name = {r["alert"]: r["expr"] for r in rules}
    assert 'reason="capacity_undrained"' in by_name["TierckptUndrainedEviction"]
    assert 'result!="ok"' in by_name["TierckptSavesFailing"]
    text = Metrics().render().decode()
    exported = set(re.findall(r"^# (?:HELP|TYPE) (\S+)", text, re.M))
    for r in rules:
        e = r["expr"]
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        used = set(re.findall(r"\btierckpt_\w+", e))
        assert used <= exported, used - exported
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
    promtool = shutil.which("promtool")
    if promtool is not None:
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
            f.flush()
            proc = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_builds_a_non_root_venv_image(k8s: dict[str, dict[str, Any]]) -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f.startswith("python:3.11-slim") for f in froms)
    assert "python -m venv /opt/tierckpt" in text and "ENV PATH=/opt/tierckpt/bin:$PATH" in text
    assert re.search(r"pip install '/src\[daemon,s3,gcs\]'", text)
    pod = k8s["DaemonSet"]["spec"]["template"]["spec"]
    (user,) = re.findall(r"^USER (\d+)", text, re.M)
    assert int(user) == pod["securityContext"]["runAsUser"] != 0
    # the probes are the kubelet's own HTTP GETs on the metrics port: nothing from the image runs for them
    assert "exec" not in _daemon_container(k8s)["startupProbe"]
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for part in src.split():
            assert (DEPLOY.parent / part).exists(), part


# --- systemd ---------------------------------------------------------------------------------------

def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Parse a unit file into section -> key -> values (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, "stray line: %r" % raw
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _systemd_toml() -> dict[str, Any]:
    return tomllib.loads((DEPLOY / "systemd" / "tierckptd.toml").read_text())


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert m, value
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


def test_systemd_unit_required_keys() -> None:
    svc = _unit(UNIT)["Service"]
    one = {k: v[-1] for k, v in svc.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert _seconds(one["WatchdogSec"]) > 0
    assert one["Restart"] == "on-failure" and "RestartSec" in one
    assert one["RuntimeDirectory"] == "tierckpt" and one["RuntimeDirectoryMode"] == "0750"
    assert one["User"] == one["Group"] == "tierckpt"
    assert one["KillSignal"] == "SIGTERM" and "LimitNOFILE" in one
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "LockPersonality"):
        assert one[key] == "yes", key
    assert one["ProtectSystem"] == "strict" and one["ReadWritePaths"]
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert _unit(UNIT)["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_execstart_flags_and_config() -> None:
    one = {k: v[-1] for k, v in _unit(UNIT)["Service"].items()}
    argv = shlex.split(one["ExecStart"])
    assert argv[0] == "/opt/tierckpt/bin/tierckptd"  # the venv the README installs
    overrides = _parse_flags(argv[1:])
    assert overrides.pop("config") == "/etc/tierckpt/tierckptd.toml"
    cfg = load_config(_systemd_toml(), overrides)
    assert Path(cfg.socket).parent == Path("/run") / one["RuntimeDirectory"]
    assert _seconds(one["TimeoutStopSec"]) > cfg.shutdown_timeout


def test_systemd_serves_the_network_only_with_mtls() -> None:
    cfg = load_config(_systemd_toml())
    assert cfg.tls_enabled and not cfg.insecure_listen and not cfg.tls_key_group_readable and cfg.tls_bind_node_id
    for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca):
        assert Path(path).parent == Path("/etc/tierckpt/tls"), path
    assert cfg.socket and cfg.socket_mode == 0o660 and cfg.socket_group  # the trainers' boundary stays
    # Without the TLS keys, the shipped listen address is refused.
    with pytest.raises(ConfigError, match="listen"):
        load_config({**_systemd_toml(), "tls_cert": "", "tls_key": "", "tls_ca": ""})
    text = (DEPLOY / "systemd" / "tierckptd.toml").read_text()
    assert "tierckpt certs ca" in text and "tierckpt certs node" in text and "-m 0600" in text


def test_systemd_toml_lists_every_key() -> None:
    values = _systemd_toml()
    assert set(values) == KEYS, "missing: %s, unknown: %s" % (KEYS - set(values), set(values) - KEYS)
    load_config(values)
    with pytest.raises(ConfigError):
        load_config({**values, "no_such_key": 1})


def test_configmap_toml_keys_are_known(k8s: dict[str, dict[str, Any]]) -> None:
    assert set(_configmap_toml(k8s)) <= KEYS


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed")
    # The binary is not installed here; verify the rest of the unit against an existing one.
    true = shutil.which("true") or "/bin/true"
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("ExecStart=/opt/tierckpt/bin/tierckptd", "ExecStart=" + true))
    proc = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    ours = [line for line in out.splitlines() if UNIT.name in line]
    assert not ours, out
    if proc.returncode != 0:
        pytest.skip("systemd-analyze verify cannot run here: %s" % out.strip()[:200])


# --- Grafana ---------------------------------------------------------------------------------------

def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "tierckpt.json").read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [v for k, v in _walk(dash) if k in ("expr", "definition") and isinstance(v, str)]
    assert exprs
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
    text = Metrics().render().decode()
    exported = set(re.findall(r"^# (?:HELP|TYPE) (\S+)", text, re.M))
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\btierckpt_\w+", e)}
    assert used and used <= exported, "unknown metrics: %s" % sorted(used - exported)
    quantiles = [e for e in exprs if "histogram_quantile" in e]
    assert any("0.5" in e for e in quantiles) and any("0.99" in e for e in quantiles)
    for operators_look_at in ("tierckpt_tier_up", "tierckpt_local_warm_bytes", "tierckpt_shared_bytes_total"):
        assert any(operators_look_at in e for e in exprs), operators_look_at


def test_systemd_install_steps_in_the_readme_match_the_unit() -> None:
    """The README installs into the venv the unit runs, and installs what Documentation= names."""
    readme = (DEPLOY.parent / "README.md").read_text()
    unit = _unit(UNIT)
    exe = shlex.split(unit["Service"]["ExecStart"][-1])[0]
    venv = str(Path(exe).parent.parent)
    assert f"python3 -m venv {venv}" in readme and f"{venv}/bin/pip install" in readme
    assert "pip install 'tierckpt[daemon" not in readme.split("**systemd**")[1].split("**Kubernetes**")[0]
    docs = [d for line in unit["Unit"]["Documentation"] for d in line.split()]
    assert docs
    for doc in docs:
        assert doc.startswith(("https://", "file:///")), doc
        if doc.startswith("file:///"):
            path = Path(doc[len("file://"):])
            assert (DEPLOY.parent / path.name).is_file(), doc  # a file of this repository ...
            assert re.search(r"install -D -m 0644 [^\n]*\b%s\b[^\n]*-t %s/" % (re.escape(path.name), path.parent),
                             readme), doc  # ... that the README's steps install there
