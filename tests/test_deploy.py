"""Static checks of the deployment files: the Dockerfile (hadolint), the Kubernetes manifests
(kubernetes-validate, strict), the compose fleets, the load balancer, Prometheus and the Grafana
dashboard, and that they all point at each other consistently. Nothing here builds or runs a
container."""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from router.cli import build_parser
from router.config import Config, ConfigError, load_config
from router.fleet.discovery import DnsDiscoveryConfig
from router.tenancy.tenants import Tenancy

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "kubernetes"
GRAFANA = DEPLOY / "grafana"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILES = ["compose.yaml", "compose.sim.yaml"]
CONFIG_PATH = "/etc/prefix-router/router.yaml"
VLLM_FLAGS = (
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--enable-force-include-usage",
)


def run(*cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    return path


# ---------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_clean() -> None:
    hadolint = need("hadolint")
    res = run(hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE))
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_dockerfile_shape() -> None:
    ins = dockerfile_instructions()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2 and any(" AS builder" in f for f in froms), "multi-stage build"
    runtime = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    words = dict(runtime)
    user = words["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric non-root user (runAsNonRoot can check it)"
    assert json.loads(words["ENTRYPOINT"]) == ["prefix-router"]
    assert json.loads(words["CMD"]) == ["serve", "--config", CONFIG_PATH]
    assert json.loads(words["HEALTHCHECK"].split("CMD", 1)[1]) == [
        "python",
        "/opt/prefix-router/healthcheck.py",
    ]
    assert any(
        r.split() == ["deploy/docker/healthcheck.py", "/opt/prefix-router/healthcheck.py"]
        for w, r in runtime
        if w == "COPY"
    )
    env = " ".join(rest for w, rest in runtime if w == "ENV")
    assert "HF_HUB_OFFLINE=1" in env
    # Nothing in the runtime stage installs packages: no compilers, no pip caches.
    assert not [r for w, r in runtime if w == "RUN" and re.search(r"apt|pip|apk", r)]
    copies = [r for w, r in runtime if w == "COPY"]
    assert any(r.startswith("--from=builder") for r in copies)
    assert any("${TOKENIZER_DIR}" in r and r.endswith("/models/tokenizer") for r in copies)
    default_tok = re.search(r"ARG TOKENIZER_DIR=(\S+)", DOCKERFILE.read_text())
    assert default_tok and (ROOT / default_tok[1] / "tokenizer.json").is_file()
    assert "USER" in words and words["EXPOSE"] == "8080"


def test_dockerignore_keeps_what_the_build_copies() -> None:
    kept = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for word, rest in dockerfile_instructions():
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, _dest = [s for s in rest.split() if not s.startswith("--")]
        for src in sources:
            src = "router" if "${TOKENIZER_DIR}" in src else src.rstrip("/")
            assert any(src == k or src.startswith(k + "/") for k in kept), src
            assert (ROOT / src).exists() or src == "README.md", src  # README: the lead's
    assert "tests" not in kept and ".git" not in kept


def test_image_default_config() -> None:
    default = DEPLOY / "docker" / "router.yaml"
    cmd = json.loads(dict(dockerfile_instructions())["CMD"])
    config = effective_config(
        cmd, {"PREFIX_ROUTER_REPLICAS": "http://vllm:8000"}, {CONFIG_PATH: default}
    )
    assert (
        config.server.host == "0.0.0.0" and config.server.port == 8080
    )  # EXPOSE, HEALTHCHECK default
    assert config.routing.tokenizer == "/models/tokenizer"
    assert config.discovery.replicas == ["http://vllm:8000"]


def load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "docker/healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_finds_the_gateway_port(tmp_path: Path) -> None:
    hc = load_healthcheck()
    cfg = tmp_path / "router.yaml"
    cfg.write_text("host: 0.0.0.0\nport: 8080\n")
    serve = ["/opt/venv/bin/python", "/opt/venv/bin/prefix-router", "serve"]
    assert hc.target([*serve, "--config", str(cfg)], {}) == "http://127.0.0.1:8080/health"
    assert (
        hc.target([*serve, "--config", str(cfg)], {"PREFIX_ROUTER_PORT": "9000"})
        == "http://127.0.0.1:9000/health"
    )
    flags_win = hc.target(
        [*serve, "--port=9100", "--config", str(cfg)], {"PREFIX_ROUTER_PORT": "1"}
    )
    assert flags_win == "http://127.0.0.1:9100/health"
    assert hc.target([*serve, "--config", str(tmp_path / "missing.yaml")], {}).endswith(
        ":8000/health"
    )
    assert hc.target([], {"PREFIX_ROUTER_HOST": "::1", "PREFIX_ROUTER_PORT": "1"}) == (
        "http://[::1]:1/health"
    )
    # The image's own default config gives the port the image EXPOSEs.
    default = str(DEPLOY / "docker/router.yaml")
    assert hc.target(["prefix-router", "serve", "--config", default], {}) == (
        "http://127.0.0.1:8080/health"
    )


def test_healthcheck_against_a_real_server(monkeypatch: pytest.MonkeyPatch) -> None:
    hc = load_healthcheck()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(hc, "_pid1_argv", lambda: ["prefix-router", "serve", "--port", str(port)])
    try:
        assert hc.main() == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert hc.main() == 1  # nothing listens there any more


# ---------------------------------------------------------------------------- compose

_VAR = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose-style ${VAR:-default} with an empty environment."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m[2] if m[2] is not None and ":-" in m[0] else "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((COMPOSE / name).read_text())
    services: dict[str, Any] = {}
    volumes: dict[str, Any] = {}
    for inc in doc.get("include", []):
        path = inc if isinstance(inc, str) else inc["path"]
        sub = load_compose(path)
        services.update(sub["services"])
        volumes.update(sub["volumes"])
    for svc in doc.get("services", {}):
        assert svc not in services, f"{name}: service {svc} defined twice"
    services.update(doc.get("services", {}))
    volumes.update(doc.get("volumes") or {})
    return interpolate({"services": services, "volumes": volumes})


def as_list(cmd: Any) -> list[str]:
    return [str(c) for c in cmd] if isinstance(cmd, list) else str(cmd).split()


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def effective_config(args: list[str], env: dict[str, str], files: dict[str, Path]) -> Config:
    """The config the gateway itself would build from ``args`` and ``env``, with in-container
    paths mapped to the files given (the gateway's own parser, not a copy of its rules)."""
    args = [str(files.get(a, a)) for a in args]
    env = {k: str(files.get(v, v)) for k, v in env.items()}
    parsed = build_parser().parse_args(args)
    config = load_config(parsed, env=env)
    Tenancy(config, env)  # the keys file and the salt secret are accepted too
    return config


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def gateways(services: dict[str, Any]) -> dict[str, Any]:
    return {
        n: s
        for n, s in services.items()
        if "entrypoint" not in s and as_list(s.get("command", []))[:1] == ["serve"]
    }


def router_config_of(svc: dict[str, Any]) -> dict[str, Any]:
    args = as_list(svc["command"])
    assert flag_value(args, "--config") == CONFIG_PATH
    for vol in svc["volumes"]:
        src, dst = vol.split(":")[:2]
        if dst == CONFIG_PATH:
            return yaml.safe_load((COMPOSE / src).read_text())
    raise AssertionError("router.yaml is not mounted")


def listen_port(svc: dict[str, Any]) -> int:
    args = as_list(svc.get("command", []))
    port = flag_value(args, "--port")
    assert port, f"no --port in {args}"
    return int(port)


def haproxy_cfg() -> tuple[int, list[tuple[str, int]]]:
    text = (COMPOSE / "haproxy.cfg").read_text()
    bind = re.search(r"^\s*bind\s+\S*:(\d+)", text, re.M)
    assert bind
    servers = re.findall(r"^\s*server\s+\S+\s+([\w.-]+):(\d+)", text, re.M)
    return int(bind[1]), [(h, int(p)) for h, p in servers]


@pytest.fixture(params=COMPOSE_FILES)
def compose(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_compose(request.param)


def test_compose_gateways_share_the_compose_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gws = gateways(services)
    assert len(gws) >= 2
    for name, gw in gws.items():
        url = urlsplit(env_of(gw)["PREFIX_ROUTER_REDIS_URL"])
        assert url.scheme == "redis"
        redis = services[url.hostname or ""]
        assert redis["image"].startswith("redis:"), name
        assert str(url.port or 6379) in [str(p) for p in redis.get("expose", [])]
        assert gw["depends_on"][url.hostname]["condition"] == "service_healthy"
        assert env_of(gw).get("PREFIX_ROUTER_SALT_SECRET"), "salt secret set"
        assert gw["image"] == "prefix-router:local" and gw["build"]["context"] == "../.."


def test_compose_gateway_config_is_accepted_by_the_gateway(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for gw in gateways(services).values():
        mount = next(v for v in gw["volumes"] if v.split(":")[1] == CONFIG_PATH)
        config = effective_config(
            as_list(gw["command"]), env_of(gw), {CONFIG_PATH: COMPOSE / mount.split(":")[0]}
        )
        assert config.server.host == "0.0.0.0"
        assert urlsplit(config.fleet.redis_url or "").hostname in services
        assert config.routing.block_size is not None, "explicit, equal to the replicas'"
        for url in config.discovery.replicas:
            assert urlsplit(url).hostname in services


def test_compose_replicas_in_router_config_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for gw in gateways(services).values():
        cfg = router_config_of(gw)
        assert cfg["replicas"], "router.yaml lists the replicas"
        for url in cfg["replicas"]:
            parts = urlsplit(url)
            assert parts.hostname in services, url
            assert parts.port == listen_port(services[parts.hostname]), url
        stop = gw["stop_grace_period"]
        assert int(stop.rstrip("s")) > cfg["shutdown_grace_s"]
        assert str(cfg["port"]) in [str(p) for p in gw["expose"]]


def test_compose_load_balancer_points_at_the_gateways(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gws = gateways(services)
    bind, servers = haproxy_cfg()
    assert {h for h, _ in servers} == set(gws)
    for host, port in servers:
        assert port == router_config_of(gws[host])["port"]
    lb = next(s for s in services.values() if any("haproxy.cfg" in v for v in s.get("volumes", [])))
    published = [str(p).rsplit(":", 1)[-1] for p in lb["ports"]]
    assert str(bind) in published


def test_compose_prometheus_targets_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prom = services["prometheus"]
    assert any(v.startswith("./prometheus.yml:") for v in prom["volumes"])
    cfg = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in cfg["scrape_configs"]
    }
    gws = gateways(services)
    assert sorted(jobs["prefix-router"]) == sorted(
        f"{n}:{router_config_of(g)['port']}" for n, g in gws.items()
    )
    replicas = router_config_of(next(iter(gws.values())))["replicas"]
    assert sorted(jobs["vllm"]) == sorted(urlsplit(u).netloc for u in replicas)
    for targets in jobs.values():
        for target in targets:
            host, port = target.split(":")
            assert host in services, target


def test_compose_healthchecks_and_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gws = gateways(services)
    assert "HEALTHCHECK" in dict(dockerfile_instructions())  # the gateways' healthcheck
    for name, svc in services.items():
        if name not in gws:
            assert "healthcheck" in svc, f"{name} has no healthcheck"
            test = as_list(svc["healthcheck"]["test"])
            assert test[0] in ("CMD", "CMD-SHELL"), name
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec.get("condition") == "service_healthy":
                assert dep in gws or "healthcheck" in services[dep], f"{name} -> {dep}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (COMPOSE / src).exists(), f"{name}: mount source {src} missing"
            else:
                assert src in compose["volumes"], f"{name}: volume {src} not declared"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} bound to all interfaces"


def test_compose_gpu_replicas_are_configured_for_the_gateway() -> None:
    services = load_compose("compose.yaml")["services"]
    cfg = router_config_of(next(iter(gateways(services).values())))
    devices = []
    for url in cfg["replicas"]:
        svc = services[urlsplit(url).hostname or ""]
        assert svc["image"].startswith("vllm/vllm-openai:")
        args = as_list(svc["command"])
        assert not args[0].startswith("-"), "first argument is the model"
        for flag in VLLM_FLAGS:
            assert flag in args, flag
        assert flag_value(args, "--block-size") == str(cfg["block_size"])
        assert "--disable-log-stats" not in args  # metrics stay on
        assert svc["ipc"] == "host"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"]
        devices += dev["device_ids"]
    assert len(devices) == len(set(devices)), "one GPU per replica"
    models = {as_list(services[urlsplit(u).hostname or ""]["command"])[0] for u in cfg["replicas"]}
    assert len(models) == 1, "same model on every replica"


def test_compose_sim_replicas_use_the_simulator() -> None:
    services = load_compose("compose.sim.yaml")["services"]
    cfg = router_config_of(next(iter(gateways(services).values())))
    for url in cfg["replicas"]:
        svc = services[urlsplit(url).hostname or ""]
        assert svc["entrypoint"] == ["python", "-m", "loadtest.replica"]
        assert flag_value(as_list(svc["command"]), "--host") == "0.0.0.0"
        assert "deploy" not in svc, "no GPU needed"
        assert svc["image"] == "prefix-router:local"
        assert flag_value(as_list(svc["command"]), "--block-size") == str(cfg["block_size"])
    gpu = load_compose("compose.yaml")["services"]
    for name in ("replica-0", "replica-1"):
        model = flag_value(as_list(services[name]["command"]), "--model")
        assert model == as_list(gpu[name]["command"])[0], "same model name as on GPUs"


def test_compose_grafana_provisioning() -> None:
    services = load_compose("compose.yaml")["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    url = urlsplit(source["url"])
    assert url.hostname in services and source["type"] == "prometheus"
    assert url.port == 9090
    dash = yaml.safe_load((GRAFANA / "provisioning/dashboards/prefix-router.yaml").read_text())
    (provider,) = dash["providers"]
    target = mounts["../grafana/prefix-router.json"]
    assert os.path.dirname(target) == provider["options"]["path"]


def test_haproxy_config_parses() -> None:
    haproxy = need("haproxy")
    res = run(haproxy, "-c", "-f", str(COMPOSE / "haproxy.cfg"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_prometheus_config_parses() -> None:
    promtool = need("promtool")
    res = run(promtool, "check", "config", "--syntax-only", str(COMPOSE / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------- Kubernetes


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_objects() -> Iterator[dict[str, Any]]:
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield doc


def k8s(kind: str, name: str) -> dict[str, Any]:
    for obj in k8s_objects():
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind}/{name}")


def containers_selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for obj in k8s_objects():
        if obj["kind"] == "Deployment":
            labels = obj["spec"]["template"]["metadata"]["labels"]
            if selector.items() <= labels.items():
                out += obj["spec"]["template"]["spec"]["containers"]
    return out


def gateway() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    dep = k8s("Deployment", "prefix-router")
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    return dep, pod, ctr


def gateway_config() -> dict[str, Any]:
    _, pod, ctr = gateway()
    assert flag_value(ctr["args"], "--config") == CONFIG_PATH
    mount = next(m for m in ctr["volumeMounts"] if CONFIG_PATH.startswith(m["mountPath"] + "/"))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = k8s("ConfigMap", vol["configMap"]["name"])
    key = next(i["key"] for i in vol["configMap"]["items"] if i["path"] == "router.yaml")
    return yaml.safe_load(cm["data"][key])


def filled_in(text: str) -> str:
    """A Secret value with the example's placeholders replaced, as the operator must."""
    digest = hashlib.sha256(b"REPLACE-ME-api-key-of-tenant-b").hexdigest()
    text = text.replace(digest, hashlib.sha256(b"a real key of tenant b").hexdigest())
    return re.sub(r"REPLACE-ME[\w-]*", lambda m: hashlib.sha256(m[0].encode()).hexdigest(), text)


def k8s_effective_config(tmp_path: Path, *, placeholders: bool = False) -> Config:
    """The gateway's config from the manifests; their Secret's placeholders filled in unless
    ``placeholders``."""
    _, pod, ctr = gateway()
    fill = (lambda v: v) if placeholders else filled_in
    files: dict[str, Path] = {}
    for mount in ctr["volumeMounts"]:
        vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        source = vol.get("configMap") or vol.get("secret")
        if not source:
            continue
        if "configMap" in vol:
            obj = k8s("ConfigMap", vol["configMap"]["name"])
            data = obj["data"]
        else:
            obj = k8s("Secret", vol["secret"]["secretName"])
            data = obj["stringData"]
        for item in source["items"]:
            path = tmp_path / mount["name"] / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(fill(data[item["key"]]))
            files[f"{mount['mountPath']}/{item['path']}"] = path
    env = {}
    for e in ctr["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = fill(k8s("Secret", ref["name"])["stringData"][ref["key"]])
    return effective_config(ctr["args"], env, files)


def test_kubernetes_gateway_config_is_accepted_by_the_gateway(tmp_path: Path) -> None:
    config = k8s_effective_config(tmp_path)
    assert config.server.host == "0.0.0.0" and config.auth.enabled is True
    assert config.auth.api_keys_file and config.auth.salt_secret
    assert (
        config.fleet.redis_url and config.discovery.discovery_dns and not config.discovery.replicas
    )
    assert config.routing.block_size is not None


def test_kubernetes_placeholders_are_refused(tmp_path: Path) -> None:
    """Applied as written, the manifests' Secret would key every tenant's salt with a
    published string and accept a published API key: the gateway refuses to start."""
    with pytest.raises(ConfigError, match="REPLACE-ME placeholder") as e:
        k8s_effective_config(tmp_path, placeholders=True)
    assert "openssl rand -hex 32" in str(e.value) or "real key" in str(e.value)
    for key in ("REPLACE-ME-api-key-of-tenant-a", "fine-key"):
        env = {"PREFIX_ROUTER_API_KEYS": f"t:{key}", "PREFIX_ROUTER_SALT_SECRET": "x" * 32}
        config = load_config(build_parser().parse_args(["serve", "--auth"]), env=env)
        if key.startswith("REPLACE-ME"):
            with pytest.raises(ConfigError, match="placeholder"):
                Tenancy(config, env)
        else:
            Tenancy(config, env)


def test_kubernetes_validate_strict() -> None:
    tool = need("kubernetes-validate")
    res = run(tool, "--strict", "--quiet", *map(str, manifest_files()))
    assert res.returncode == 0, res.stdout + res.stderr


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == [p.name for p in manifest_files()]
    images = {i["name"] for i in kust.get("images", [])}
    _, _, ctr = gateway()
    assert ctr["image"] in images
    # The discovery name below assumes the namespace "default".
    assert kust.get("namespace", "default") == "default"


def pod_template_annotations(dep: dict[str, Any]) -> dict[str, str]:
    return dict(dep["spec"]["template"]["metadata"].get("annotations") or {})


def test_gateway_deployment() -> None:
    dep, pod, ctr = gateway()
    assert dep["spec"]["replicas"] >= 2
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/health"
    port_names = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert ctr[probe]["httpGet"]["port"] in port_names
    cfg = gateway_config()
    assert port_names["http"] == cfg["port"]
    # Auth is on, so Prometheus scrapes the key-less metrics-only listener.
    assert cfg["auth"] is True and port_names["metrics"] == cfg["metrics_port"]
    annotations = pod_template_annotations(dep)
    assert int(annotations["prometheus.io/port"]) == cfg["metrics_port"]
    pre_stop = ctr["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + cfg["shutdown_grace_s"]
    # non-root, read-only root filesystem, the image's user
    user = dict(dockerfile_instructions())["USER"].split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == user
    sc = ctr["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert any(m["mountPath"] == "/tmp" for m in ctr["volumeMounts"])
    assert ctr["resources"]["requests"]["cpu"] and ctr["resources"]["limits"]["memory"]


def test_gateway_secrets_and_redis() -> None:
    _, pod, ctr = gateway()
    env = {e["name"]: e for e in ctr["env"]}
    secret = k8s("Secret", "prefix-router-secrets")
    for e in env.values():
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert k8s("Secret", ref["name"])["stringData"][ref["key"]]
    assert "secretKeyRef" in env["PREFIX_ROUTER_SALT_SECRET"]["valueFrom"]
    keys_file = env["PREFIX_ROUTER_API_KEYS_FILE"]["value"]
    mount = next(m for m in ctr["volumeMounts"] if keys_file.startswith(m["mountPath"] + "/"))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    item = next(i for i in vol["secret"]["items"] if keys_file.endswith("/" + i["path"]))
    assert item["key"] in secret["stringData"]
    for value in secret["stringData"].values():
        assert "REPLACE-ME" in value, "placeholders are marked"

    url = urlsplit(env["PREFIX_ROUTER_REDIS_URL"]["value"])
    svc = k8s("Service", url.hostname or "")
    (port,) = svc["spec"]["ports"]
    assert port["port"] == (url.port or 6379)
    (redis,) = containers_selected(svc["spec"]["selector"])
    assert redis["image"].startswith("redis:")
    assert port["targetPort"] in {p["name"] for p in redis["ports"]}


def test_services_select_pods_with_their_ports() -> None:
    for obj in k8s_objects():
        if obj["kind"] != "Service":
            continue
        ctrs = containers_selected(obj["spec"]["selector"])
        assert ctrs, f"service {obj['metadata']['name']} selects nothing"
        names = {p["name"] for c in ctrs for p in c.get("ports", [])}
        for port in obj["spec"]["ports"]:
            assert port["targetPort"] in names, obj["metadata"]["name"]
    pdb = k8s("PodDisruptionBudget", "prefix-router")
    dep, _, _ = gateway()
    assert pdb["spec"]["selector"] == dep["spec"]["selector"]
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]


def test_discovery_points_at_the_headless_service(tmp_path: Path) -> None:
    cfg = gateway_config()
    disc = DnsDiscoveryConfig.from_config(k8s_effective_config(tmp_path).discovery)
    assert disc is not None
    svc_name, namespace, rest = disc.dns.split(".", 2)
    assert rest == "svc.cluster.local" and namespace == "default"
    svc = k8s("Service", svc_name)
    assert svc["spec"]["clusterIP"] == "None" and not svc["spec"].get("publishNotReadyAddresses")
    (port,) = svc["spec"]["ports"]
    assert port["port"] == disc.port
    (vllm,) = containers_selected(svc["spec"]["selector"])
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert ports[port["targetPort"]] == disc.port
    assert vllm["image"].startswith("vllm/vllm-openai:")
    args = vllm["args"]
    assert not args[0].startswith("-"), "first argument is the model"
    for flag in VLLM_FLAGS:
        assert flag in args, flag
    assert flag_value(args, "--block-size") == str(cfg["block_size"])
    assert flag_value(args, "--port") == str(disc.port)
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"]


# ---------------------------------------------------------------------------- Grafana


def dashboard() -> dict[str, Any]:
    return json.loads((GRAFANA / "prefix-router.json").read_text())


def queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_dashboard_panels_all_have_queries() -> None:
    dash = dashboard()
    var = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var and var[0]["query"] == "prometheus"
    ds_ref = "${" + var[0]["name"] + "}"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == ds_ref, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == ds_ref


def test_dashboard_covers_the_fleet() -> None:
    exprs = "\n".join(queries())
    assert (
        "sum(rate(vllm:prefix_cache_hits_total[5m])) / sum(rate(vllm:prefix_cache_queries_total[5m]))"
        in exprs
    )
    for metric in (
        "prefix_router_reuse_available_tokens_total",
        "prefix_router_reuse_captured_tokens_total",
        "prefix_router_reuse_delivered_tokens_total",
        "prefix_router_decisions_total",
        "prefix_router_inflight_requests",
        "prefix_router_requests_total",
        "prefix_router_replica_healthy",
        "prefix_router_redis_up",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        # failures and pressure
        "prefix_router_replica_ejections_total",
        "prefix_router_retries_total",
        "prefix_router_spills_total",
        "prefix_router_rejected_requests_total",
        "vllm:request_queue_time_seconds_bucket",
        "prefix_router_ideal_hit_rate",
        "prefix_router_available_hit_rate",
        "prefix_router_captured_hit_rate",
        "prefix_router_delivered_hit_rate",
        "prefix_router_build_info",
    ):
        assert metric in exprs, metric
    for hist in (
        "vllm:time_to_first_token_seconds_bucket",
        "prefix_router_upstream_ttft_seconds_bucket",
    ):
        assert re.search(r"histogram_quantile\(0\.99, sum by \(le\) \(rate\(" + hist, exprs), hist


def test_dashboard_redis_panels_say_fleet_mode_only() -> None:
    """prefix_router_redis_up and the fallbacks exist only on gateways with redis_url: their
    panels sit under a row that says so, and no other panel depends on them."""
    row = ""
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        exprs = " ".join(t["expr"] for t in panel["targets"])
        if "prefix_router_redis" in exprs:
            assert row.startswith("Fleet mode (Redis)") and "no data" in row, panel["title"]
            assert "fleet mode" in panel["title"].lower() or "redis" in panel["title"].lower()


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    promtool = need("promtool")
    rules = [
        {"record": f"dashboard:q{i}", "expr": e.replace("$__rate_interval", "1m")}
        for i, e in enumerate(queries())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = run(promtool, "check", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
