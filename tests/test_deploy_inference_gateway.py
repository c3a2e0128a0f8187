"""Static checks of deploy/kubernetes/inference-gateway/: the InferencePool and HTTPRoute
against their APIs' own CRDs (vendored under tests/data/k8s/, nothing fetched), the EPP Service and the
patched gateway Deployment with kubernetes-validate, and that the pool, the route, the
Service, the Deployment's ext_proc port and the gateway's own configuration point at each
other."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from router.cli import build_parser
from router.config import load_config
from tests.test_deploy import K8S, k8s

OVERLAY = K8S / "inference-gateway"
CRDS = Path(__file__).resolve().parent / "data" / "k8s"
CRD_FILES = {
    "InferencePool": "gateway-api-inference-extension-v1.6.0/inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway-api-v1.6.1/gateway.networking.k8s.io_httproutes.yaml",
}


def strict(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it with strict field validation
    (kubectl's default since Kubernetes 1.27): an unknown field is an error, not pruned. So
    every object with declared properties is closed, unless it says it keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k != "properties" else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


def crd_schema(kind: str) -> dict[str, Any]:
    """The served version's ``openAPIV3Schema`` of ``kind``'s vendored CRD, with apiVersion and
    kind pinned to it (the API server routes by them before any schema applies)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the HTTPRoute CRD is 430 kB
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=loader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "spec"})
    jsonschema.Draft7Validator.check_schema(schema)
    return schema


def overlay(kind: str) -> dict[str, Any]:
    for path in sorted(OVERLAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                return doc
    raise AssertionError(f"no {kind} in the overlay")


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as kustomize applies these: maps merged, ``null`` deletes,
    containers matched by name and ports by containerPort."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out
    if isinstance(base, list) and isinstance(patch, list) and patch and isinstance(patch[0], dict):
        key = "name" if "name" in patch[0] and "image" in base[0] else "containerPort"
        if key not in patch[0]:
            return patch
        out = [dict(b) for b in base]
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if match is None:
                out.append(item)
            else:
                out[match] = merge(out[match], item)
        return out
    return patch


def patched_gateway() -> dict[str, Any]:
    kust = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    (patch_file,) = [p["path"] for p in kust["patches"]]
    patch = yaml.safe_load((OVERLAY / patch_file).read_text())
    assert patch["kind"] == "Deployment"
    return merge(copy.deepcopy(k8s("Deployment", patch["metadata"]["name"])), patch)


def test_kustomization_builds_on_the_base_and_lists_every_file() -> None:
    kust = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kust["resources"][0] == "../"
    listed = set(kust["resources"][1:]) | {p["path"] for p in kust["patches"]}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("kind", ["InferencePool", "HTTPRoute"])
def test_against_the_apis_own_crd(kind: str) -> None:
    errors = list(jsonschema.Draft7Validator(crd_schema(kind)).iter_errors(overlay(kind)))
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]


def test_the_crds_refuse_what_the_apis_refuse() -> None:
    spec = crd_schema("InferencePool")
    pool = overlay("InferencePool")
    for bad in (
        {"failureMode": "Sometimes"},
        {"port": {"number": 70000}},
        {"nmae": "typo"},
    ):
        broken = copy.deepcopy(pool)
        broken["spec"]["endpointPickerRef"].update(bad)
        assert not jsonschema.Draft7Validator(spec).is_valid(broken), bad
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 8000 + i} for i in range(9)]  # at most 8
    assert not jsonschema.Draft7Validator(spec).is_valid(broken)
    route = crd_schema("HTTPRoute")
    for path, value in (
        (("spec", "rules"), [{"backendRefs": [{"name": "x", "wieght": 1}]}]),
        (("apiVersion",), "gateway.networking.k8s.io/v2"),
    ):
        broken = copy.deepcopy(overlay("HTTPRoute"))
        target = broken
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert not jsonschema.Draft7Validator(route).is_valid(broken), path


def test_the_pool_the_route_the_service_and_the_gateway_agree(tmp_path: Path) -> None:
    pool, route, svc = overlay("InferencePool"), overlay("HTTPRoute"), overlay("Service")
    dep = patched_gateway()
    ref = pool["spec"]["endpointPickerRef"]
    # CEL rules of the CRD: a Service picker names its port; target ports are unique.
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))
    # The route's backend is the pool; the pool's picker is the EPP Service...
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    assert ref["name"] == svc["metadata"]["name"]
    (port,) = svc["spec"]["ports"]
    assert port["port"] == ref["port"]["number"]
    # ...which selects the gateway pods, whose ext_proc port it targets...
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (ctr,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports[port["targetPort"]] == 9002 and "http" in ports
    args = ctr["args"]
    assert args[args.index("--ext-proc-port") + 1] == str(ports["ext-proc"])
    config = load_config(build_parser().parse_args(args[:1] + args[3:]), env={})
    assert config.server.ext_proc_port == ports["ext-proc"]
    assert ctr["readinessProbe"] == {
        **{k: v for k, v in ctr["readinessProbe"].items() if k != "grpc"},
        "grpc": {"port": 9002, "service": "readiness"},
    }
    assert ctr["livenessProbe"]["grpc"]["service"] == "liveness"
    assert "httpGet" not in ctr["readinessProbe"] and "httpGet" not in ctr["livenessProbe"]
    # ...and the pool's pods are the replicas the gateway discovers, on the same port.
    vllm = k8s("Deployment", "vllm")
    assert pool["spec"]["selector"]["matchLabels"].items() <= (
        vllm["spec"]["template"]["metadata"]["labels"].items()
    )
    (vctr,) = vllm["spec"]["template"]["spec"]["containers"]
    assert numbers == [p["containerPort"] for p in vctr["ports"] if p["name"] == "http"]

    tool = shutil.which("kubernetes-validate")
    if tool is None:
        pytest.skip("kubernetes-validate is not installed")
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(dep))
    res = subprocess.run(
        [
            tool,
            "--strict",
            "--quiet",
            str(tmp_path / "deployment.yaml"),
            str(OVERLAY / "epp-service.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
