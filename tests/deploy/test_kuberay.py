"""The KubeRay manifest (deploy/kuberay/rayservice.yaml) and the image recipe
(deploy/docker/Dockerfile), checked without Kubernetes or Docker.

Where the facts come from:
- tests/deploy/schemas/rayservice.schema.json is flotilla's own JSON Schema for the
  RayService v1 fields the manifest uses. Types, required fields and the enums of
  ``authOptions.mode`` and ``autoscalerOptions.upscalingMode``/``version`` are KubeRay's
  CRD's (ray-operator/config/crd/bases/ray.io_rayservices.yaml, version v1); the enum of
  ``upgradeStrategy.type``, the name rule (DNS-1035 label of at most 47 characters) and the
  checks in :func:`test_the_operator_would_accept_it` are the operator's validation
  (ray-operator/controllers/ray/utils/validation.go and the Go types in
  ray-operator/apis/ray/v1); pod enums (pull policy, protocol, toleration operator and
  effect) are Kubernetes core/v1's. The CRD leaves unknown fields to the API server, which
  refuses them under kubectl's strict field validation: the schema refuses them too.
- serveConfigV2 is parsed by Ray Serve's own ``ServeDeploySchema`` and its arguments by
  flotilla's ``parse_build_args`` (what ``flotilla.serve.app:build`` runs first).
- The autoscaler's view of the groups is computed by Ray's own KubeRay autoscaler code.
"""

import copy
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from flotilla.serve.app import parse_build_args

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
SCHEMA = Path(__file__).parent / "schemas" / "rayservice.schema.json"
EXAMPLE = ROOT / "deploy" / "examples" / "elastic-ep-moe.yaml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
TORCH_PIN = ROOT / "deploy" / "docker" / "torch-cu130.txt"


@pytest.fixture(scope="module")
def manifest():
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def serve_config(manifest):
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def problems(validator, document):
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(document)]


def containers(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_the_manifest_matches_the_schema(manifest, validator):
    assert problems(validator, manifest) == []


def _set(document, path, value):
    *parents, last = path
    for key in parents:
        document = document[key]
    if value is _DELETE:
        del document[last]
    else:
        document[last] = value


_DELETE = object()
_CLUSTER = ("spec", "rayClusterConfig")
_WORKER = (*_CLUSTER, "workerGroupSpecs", 0)


@pytest.mark.parametrize(
    "path, value, where",
    [
        ((*_CLUSTER, "headGroupSpec", "rayStartParams", "num-cpus"), 0, "rayStartParams.num-cpus"),  # must be "0"
        ((*_CLUSTER, "authOptions", "mode"), "Token", "authOptions.mode"),
        ((*_WORKER, "minReplicas"), "1", "minReplicas"),
        ((*_WORKER, "groupName"), _DELETE, "workerGroupSpecs.0"),
        (("spec", "upgradeStrategy", "type"), "Recreate", "upgradeStrategy.type"),  # RayCluster's, not RayService's
        (("spec", "upgradeStrategy", "type"), None, "upgradeStrategy.type"),  # `type: None` unquoted is fine; `~` is null
        ((*_CLUSTER, "enableInTreeAutoScaling"), True, "rayClusterConfig"),  # a misspelt field
        ((*_WORKER, "template", "spec", "containers", 0, "resources", "limits", "memory"), "128GB", "limits.memory"),
        (("metadata", "name"), "Flotilla_1", "metadata.name"),
        ((*_WORKER, "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"), 8000.5, "httpGet.port"),
    ],
)
def test_the_schema_refuses_common_mistakes(manifest, validator, path, value, where):
    broken = copy.deepcopy(manifest)
    _set(broken, path, value)
    found = problems(validator, broken)
    assert found and all(where in p for p in found), found


def test_the_operator_would_accept_it(manifest):
    """KubeRay's validation beyond the CRD's types, for what the manifest sets."""
    cluster = manifest["spec"]["rayClusterConfig"]
    name = manifest["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    for group in cluster["workerGroupSpecs"]:
        low, high = group["minReplicas"], group["maxReplicas"]
        assert 0 <= low <= group.get("replicas", low) <= high, group["groupName"]
        if group.get("resources"):  # NOTE: not both ways of giving a group's Ray resources
            assert not {"num-cpus", "num-gpus", "memory", "resources"} & set(group.get("rayStartParams", {}))
    if cluster.get("authOptions", {}).get("mode", "token") == "token":
        assert tuple(map(int, cluster["rayVersion"].split("."))) >= (2, 52, 0)  # token auth's minimum Ray
        assert not cluster["authOptions"].get("enableK8sTokenAuth")  # unsupported for RayService


def test_upgrades_need_no_second_cluster(manifest):
    """``None``: KubeRay never starts a second RayCluster (``NewCluster`` would, with its own GPU
    pods; ``NewClusterWithIncrementalUpgrade`` too, for this one-replica application, and it
    needs the Gateway API and a feature gate). A serveConfigV2 change rolls in place through
    Serve's replica drain (docs/configuration.md, shutdown)."""
    strategy = manifest["spec"]["upgradeStrategy"]
    assert strategy == {"type": "None"}, strategy
    text = MANIFEST.read_text()
    assert 'type: "None"' in text  # NOTE: quoted, so no YAML reader takes it for null
    assert "NewCluster" in text and "shutdown_timeout_s" in text  # the comment says what the others cost


def test_it_runs_the_ray_flotilla_pins(manifest):
    ray_pin = next(d for d in pyproject()["dependencies"] if d.startswith("ray["))
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == ray_pin.split("==")[1]
    assert {c["image"] for c in containers(manifest)} == {f"flotilla:{pyproject()['version']}"}


def test_serve_config_is_flotillas_application(serve_config):
    config = ServeDeploySchema.model_validate(serve_config)
    (app,) = config.applications
    assert app.import_path == "flotilla.serve.app:build"
    given, options = parse_build_args(app.args)  # NOTE: raises on an argument build() would refuse
    assert given["elastic_ep_backend"] == "ray" and options["elastic_ep_autoscale"] is True


def test_serve_config_is_the_elastic_example(serve_config):
    example = yaml.safe_load(EXAMPLE.read_text())
    assert serve_config["applications"][0]["args"] == example["applications"][0]["args"]
    assert serve_config["http_options"]["port"] == example["http_options"]["port"]


def test_probes_and_ports_reach_the_serve_proxy(manifest, serve_config):
    port = serve_config["http_options"]["port"]
    # NOTE: worker pods are probed through their own proxy, so there must be one per node.
    assert serve_config["proxy_location"] == "EveryNode" and serve_config["http_options"]["host"] == "0.0.0.0"
    for container in containers(manifest):
        assert {"name": "serve", "containerPort": port} in container["ports"], container["name"]
    head, *workers = containers(manifest)
    assert "readinessProbe" not in head and "livenessProbe" not in head  # KubeRay's own; see the manifest
    for worker in workers:
        assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}


def test_the_autoscaler_can_grow_the_group_to_max_ep_size(manifest, serve_config):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    types = _derive_autoscaling_config_from_ray_cr(
        {"metadata": {"name": "flotilla", "namespace": "default"}, "spec": cluster}
    )["available_node_types"]
    head, gpu = types.pop("headgroup"), types.pop("gpu")
    assert head["resources"]["CPU"] == 0 and not types
    args = serve_config["applications"][0]["args"]
    assert gpu["min_workers"] >= 1  # the first rank, and the platform probe, need a GPU node
    assert gpu["resources"]["GPU"] * gpu["max_workers"] >= args["max_ep_size"]
    for resources in args["placement"].values():  # every pinned group has nodes to go to
        assert all(gpu["resources"].get(name, 0) >= amount for name, amount in resources.items()), resources


def test_token_auth_comes_from_a_named_secret(manifest):
    auth = manifest["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token", "secretName": "flotilla-ray-token"}
    # NOTE: KubeRay reads the key `auth_token`; the manifest's instructions must create it.
    assert "kubectl create secret generic flotilla-ray-token --from-literal=auth_token=" in MANIFEST.read_text()


def dockerfile_stages(text):
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments); comments dropped,
    continuation lines joined."""
    lines = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    stages = []
    for line in re.sub(r"\\[ \t]*\n", " ", lines).splitlines():
        instruction, _, args = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages and instruction:
            stages[-1].append((instruction.upper(), " ".join(args.split())))
    return stages


def test_the_image_serves_and_installs_offline(manifest):
    stages = dockerfile_stages(DOCKERFILE.read_text())
    final = dict(stages[-1])
    assert json.loads(final["ENTRYPOINT"]) == ["flotilla", "serve"]
    assert final["USER"].split(":")[0] not in ("0", "root")
    exposed = {int(p) for p in final["EXPOSE"].split()}
    assert {p["containerPort"] for c in containers(manifest) for p in c["ports"]} <= exposed
    # NOTE: flotilla comes from the wheelhouse copied in, with no index.
    copies = [args.split() for stage in stages for op, args in stage if op == "COPY" and "wheelhouse" in args]
    ((_, into),) = copies
    installs = [args for stage in stages for op, args in stage if op == "RUN" and "pip install" in args]
    assert len(installs) == 1 and "--no-index" in installs[0] and f"--find-links {into.rstrip('/')}" in installs[0]


def test_the_base_image_matches_the_torch_build():
    base = re.search(r"ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu24\.04", DOCKERFILE.read_text())
    pin = re.search(r"^torch==[\d.]+\+cu(\d+)$", TORCH_PIN.read_text(), re.MULTILINE)
    assert base and pin and pin.group(1) == base.group(1) + base.group(2)
