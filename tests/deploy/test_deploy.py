"""deploy/: the Kubernetes manifests against the API's own schemas (packaged with kubernetes-validate, so
nothing is downloaded), what the manifests must agree on with each other and with the code, and the
Dockerfiles as parsed by dockerfile-parse. The image itself builds where a container builder exists
(docs/deploy.md)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from metronome.config import GatewayConfig
from metronome.serving.gateway.discovery import parse_workers

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
# gRPC probes are GA from Kubernetes 1.27; the newest schemas the package ships are checked too.
VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]


def resources() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict]:
    return [r for r in resources() if r["kind"] == kind]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_for_the_kubernetes_api(path, version):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)   # unknown fields fail too


def test_the_gateways_find_the_workers_through_the_headless_service():
    (gateway,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "metronome-gateway"]
    args = container(gateway)["args"]
    GatewayConfig(workers=(flag(args, "--workers"),))   # the config takes it
    (name, port), = parse_workers((flag(args, "--workers"),)).names
    (service,) = [s for s in by_kind("Service") if s["metadata"]["name"] == name]
    assert service["spec"]["clusterIP"] == "None" and port in [p["port"] for p in service["spec"]["ports"]]
    workers = [d for d in by_kind("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert workers
    for worker in workers:
        labels = worker["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert port in [p["containerPort"] for p in container(worker)["ports"]]


def test_gpu_workers_take_one_gpu_each_and_are_probed_over_grpc():
    (gpu,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "metronome-worker"]
    c = container(gpu)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and flag(c["args"], "--device") == "cuda"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == int(flag(c["args"], "--port"))


def test_pods_outlive_their_drain_and_gateways_are_scraped_and_probed_where_they_answer():
    for deployment in by_kind("Deployment"):
        spec, c = deployment["spec"]["template"]["spec"], container(deployment)
        assert spec["terminationGracePeriodSeconds"] > float(flag(c["args"], "--drain-grace-s"))
    (gateway,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "metronome-gateway"]
    c, notes = container(gateway), gateway["spec"]["template"]["metadata"]["annotations"]
    port = int(flag(c["args"], "--port"))
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == port
    assert notes["prometheus.io/path"] == "/metrics"
    assert (c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/live")
    http = (ROOT / "metronome/serving/gateway/http.py").read_text()
    assert all(f'path == "{p}"' in http for p in ("/ready", "/live", "/metrics"))


def parsed(name: str) -> DockerfileParser:
    parser = DockerfileParser(fileobj=io.BytesIO((DEPLOY / name).read_bytes()))   # in memory: nothing written
    assert parser.structure
    return parser


def instructions(parser: DockerfileParser, kind: str) -> list[str]:
    return [i["value"] for i in parser.structure if i["instruction"] == kind]


def lock_python() -> str:
    return re.search(r"--python-version (\S+)", (ROOT / "requirements.lock").read_text()).group(1)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_each_image_installs_the_lock_with_its_hashes_and_runs_as_a_user(name):
    parser = parsed(name)
    runs = " ".join(instructions(parser, "RUN"))
    assert "--require-hashes -r requirements.lock" in runs and "--no-deps" in runs
    assert any("requirements.lock" in c for c in instructions(parser, "COPY"))
    assert instructions(parser, "USER") and instructions(parser, "USER")[-1] != "root"
    assert parser.json and '"metronome"' in instructions(parser, "ENTRYPOINT")[0]


def test_the_cpu_image_takes_the_lock_python_and_the_makefile_torch():
    parser = parsed("Dockerfile")
    assert parser.baseimage.startswith(f"python:{lock_python()}-")
    torch = re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert parser.args["TORCH_SPEC"] == torch
    exposed = " ".join(instructions(parser, "EXPOSE")).split()
    assert {"8000", "50051"} <= set(exposed)


def test_the_cuda_image_starts_from_an_official_pytorch_base():
    parser = parsed("Dockerfile.cuda")
    (default,) = instructions(parser, "ARG")[:1]     # the ARG before FROM: the base, resolved in baseimage
    base = parser.baseimage
    assert default == f'PYTORCH_IMAGE="{base}"' and base.startswith("pytorch/pytorch:") and "cuda" in base
    assert "torch" not in " ".join(instructions(parser, "RUN")).replace("requirements.lock", "")
