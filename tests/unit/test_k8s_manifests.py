"""deploy/k8s as Kubernetes would take it: every object of each layout (the default, tls/ and
leaderworkerset/) is valid against the Kubernetes 1.37 schemas in strict mode (unknown fields
refused; the kubernetes-validate package), the LeaderWorkerSet against a vendored schema of its
API with its pod templates as Kubernetes PodTemplateSpecs, and every container's command line
and QWEN3_SERVE_* variables are accepted by the real argument parsers of the services. The
wiring is checked too: ports, probes, mounted secrets, the scheduler's worker list against the
pods' DNS names, Service and NetworkPolicy selectors.

A layout is assembled by `kubectl kustomize` where kubectl is installed (CI has it); elsewhere by
a small emulation of kustomize for exactly the features the layouts use (resources, ConfigMap
patches, labels, images), where a kustomization using anything else fails rather than being
half-understood. Where both exist, they must assemble every layout alike.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from tests.support.procs import REPO  # noqa: E402

K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.37.0"
LAYOUTS = ("", "tls", "leaderworkerset")
LWS_SCHEMA = json.loads((REPO / "tests" / "support" / "schemas" / "leaderworkerset-v1.json").read_text())
# What the LeaderWorkerSet controller sets in each pod (for group g, pod i of `size`).
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "patches", "labels", "images"}
KUBECTL = shutil.which("kubectl")


# libyaml's parser where PyYAML has it: the same safe loading, several times faster.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_all(text: str) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=SAFE_LOADER) if doc]


def load(path: pathlib.Path) -> list[dict]:
    return load_all(path.read_text())


def build(directory: pathlib.Path) -> list[dict]:
    """A layout's objects, as `kubectl apply -k` would create them."""
    return kustomize(directory) if KUBECTL else emulate(directory)


def kustomize(directory: pathlib.Path) -> list[dict]:
    """A layout assembled by kubectl's own kustomize (run once per layout; fresh objects each call)."""
    return load_all(_kustomized(directory))


@functools.cache
def _kustomized(directory: pathlib.Path) -> str:
    out = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, f"kubectl kustomize {directory}: {out.stderr}"
    return out.stdout


def emulate(directory: pathlib.Path) -> list[dict]:
    """A layout assembled by the emulation, for machines without kubectl."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= KUSTOMIZE_KEYS, f"{directory}: kustomize features this test cannot emulate"
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += emulate(path) if path.is_dir() else load(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, patch
        for change in load(directory / patch["path"]):
            assert change["kind"] == "ConfigMap", "only ConfigMap data patches are emulated"
            [target] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == change["metadata"]["name"]]
            target["data"].update(change["data"])
    for entry in kustomization.get("labels", []):
        assert set(entry) == {"pairs"}, "labels: only metadata labels (no selectors) are emulated"
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
    tags = {image["name"]: image["newTag"] for image in kustomization.get("images", [])}
    for doc in docs:
        for pod in pod_specs(doc):
            for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
                if container["image"] in tags:
                    container["image"] += f":{tags[container['image']]}"
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"{directory}: an object is defined twice: {keys}"
    return docs


def pod_specs(doc: dict) -> list[dict]:
    """The pod templates of a workload."""
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        template = doc["spec"]["leaderWorkerTemplate"]
        return [template[k] for k in ("leaderTemplate", "workerTemplate") if k in template]
    return []


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: layout or "default")
def layout(request) -> tuple[str, list[dict]]:
    return request.param, build(K8S / request.param)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
@pytest.mark.parametrize("directory", LAYOUTS + ("gateway",), ids=lambda layout: layout or "default")
def test_the_emulation_assembles_each_layout_as_kubectl_does(directory):
    def by_name(docs: list[dict]) -> dict:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert by_name(emulate(K8S / directory)) == by_name(kustomize(K8S / directory))


def test_every_object_is_valid_for_kubernetes(layout):
    _, docs = layout
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            jsonschema.validate(doc, LWS_SCHEMA)
            for template in pod_specs(doc):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                              "template": template}, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_optional_files_are_valid_too():
    for doc in load(K8S / "secrets.example.yaml"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    [monitor] = load(K8S / "podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    [scheduler] = find(build(K8S), "Deployment", "qwen3-serve-scheduler")
    pod = scheduler["spec"]["template"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == pod["metadata"]["annotations"]["prometheus.io/path"]
    assert str(ports[endpoint["port"]]) == pod["metadata"]["annotations"]["prometheus.io/port"]


def test_a_broken_manifest_is_caught():
    """The validation is strict: a misspelt field or a bad value fails."""
    [statefulset] = find(build(K8S), "StatefulSet")
    broken = copy.deepcopy(statefulset)
    broken["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    [lws] = find(build(K8S / "leaderworkerset"), "LeaderWorkerSet")
    broken = copy.deepcopy(lws)
    broken["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, LWS_SCHEMA)


# ---- command lines ------------------------------------------------------------------------------

def _help_text(parse) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"])
    return out.getvalue()


def _parsers():
    from common.healthcheck import build_parser as healthcheck_parser
    from scheduler_svc.__main__ import parse_args as scheduler_parse_args
    from worker_svc.__main__ import build_parser as worker_parser
    from worker_svc.config import worker_config_from_args

    def parse_worker(argv):
        args = worker_parser().parse_args(argv)
        worker_config_from_args(args)    # the checks the worker makes before it starts (rank < size, ...)
        return args

    return {"scheduler_svc": scheduler_parse_args, "worker_svc": parse_worker,
            "common.healthcheck": healthcheck_parser().parse_args}


def container_env(container: dict, docs: list[dict], injected: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        [config] = find(docs, "ConfigMap", source["configMapRef"]["name"])
        env.update(config["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return {**injected, **env}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    def value(match):
        assert match.group(1) in env, f"$({match.group(1)}) is not defined in the container"
        return env[match.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)


def parse_in_env(parse, argv: list[str], env: dict[str, str]):
    """Parses argv as the program would in a process whose environment is `env`."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("QWEN3_SERVE_")}
    for name in saved:
        del os.environ[name]
    os.environ.update({k: v for k, v in env.items() if k.startswith("QWEN3_SERVE_")})
    try:
        return parse(argv)
    except SystemExit as exc:
        raise AssertionError(f"rejected: {shlex.join(argv)} with {env}") from exc
    finally:
        for name in [k for k in os.environ if k.startswith("QWEN3_SERVE_")]:
            del os.environ[name]
        os.environ.update(saved)


def mounted_file(pod: dict, container: dict, path: str, docs: list[dict], secrets: dict[str, dict]) -> None:
    """Fails unless `path` is a file of a Secret volume mounted into the container."""
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
            secret = volume["secret"]
            files = [item["path"] for item in secret["items"]] if "items" in secret else \
                list(secrets[secret["secretName"]]["stringData"])
            assert path[len(prefix):] in files, f"{path}: no such file in Secret {secret['secretName']}"
            keys = [item["key"] for item in secret.get("items", [])]
            assert set(keys) <= set(secrets[secret["secretName"]]["stringData"]), keys
            return
    raise AssertionError(f"{path} is not under any volume mount of {container['name']}")


def _containers(docs: list[dict], lws_pod: tuple[int, int] | None = None):
    """(workload, pod template, container, variables the controller injects) for every container."""
    for doc in docs:
        for pod in pod_specs(doc):
            injected = {}
            if doc["kind"] == "LeaderWorkerSet":
                name, size = doc["metadata"]["name"], doc["spec"]["leaderWorkerTemplate"]["size"]
                group, index = lws_pod or (0, 0)
                injected = {"LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.default", "LWS_GROUP_SIZE": str(size),
                            "LWS_WORKER_INDEX": str(index)}
            for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
                yield doc, pod, container, injected


def test_every_command_line_is_one_the_services_accept(layout):
    _, docs = layout
    parsers = _parsers()
    known_vars = {module: set(re.findall(r"env\s+(QWEN3_SERVE_[A-Z0-9_]+)", _help_text(parse)))
                  for module, parse in parsers.items()}
    secrets = {s["metadata"]["name"]: s for s in load(K8S / "secrets.example.yaml")}
    checked = set()
    for lws_pod in ((0, 0), (0, 1)):    # the leader and a worker of an LWS group; others are alike
        for _doc, pod, container, injected in _containers(docs, lws_pod):
            env = container_env(container, docs, injected)
            command = [expand(part, env) for part in container["command"] + container.get("args", [])]
            if command[:2] == ["python", "-c"]:
                compile(command[2], container["name"], "exec")   # the model download script
                assert {"MODEL_ID", "MODEL_DIR"} <= set(env)
                continue
            assert command[:2] == ["python", "-m"] and command[2] in parsers, command
            module, argv = command[2], command[3:]
            unknown = {k for k in env if k.startswith("QWEN3_SERVE_")} - known_vars[module]
            assert not unknown, f"{container['name']}: {module} reads no {unknown}"
            args = parse_in_env(parsers[module], argv, env)
            checked.add(module)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["grpc"] == args.port and args.host == "0.0.0.0"
            for flag in ("auth_token_file", "worker_auth_token_file", "tls_cert", "tls_key"):
                if getattr(args, flag, None):
                    mounted_file(pod, container, getattr(args, flag), docs, secrets)
            if module == "scheduler_svc":
                assert args.auth_token_file, "the public API must require a token"
                assert ports["metrics"] == args.metrics_port
            else:
                assert args.auth_token_file, "a worker must accept only its scheduler"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container[kind]
                if "grpc" in probe:
                    assert probe["grpc"]["port"] == args.port and not args.tls_cert, "kubelet gRPC probes are plaintext"
                else:
                    probe_argv = probe["exec"]["command"]
                    assert probe_argv[:3] == ["python", "-m", "common.healthcheck"], probe_argv
                    probe_args = parse_in_env(parsers["common.healthcheck"], probe_argv[3:], {})
                    assert probe_args.address == f"127.0.0.1:{args.port}"
                    mounted_file(pod, container, probe_args.tls_ca, docs, {**secrets, "qwen3-serve-tls": {
                        "stringData": secrets["qwen3-serve-tls"]["stringData"]}})
    assert checked == {"scheduler_svc", "worker_svc"}


def test_the_scheduler_lists_every_worker_pod_by_its_dns_name(layout):
    name, docs = layout
    [config] = find(docs, "ConfigMap", "qwen3-serve-scheduler")
    addresses = config["data"]["QWEN3_SERVE_WORKERS"].split(",")
    tp_size = int(config["data"]["QWEN3_SERVE_TENSOR_PARALLEL_SIZE"])
    services = {s["metadata"]["name"]: s for s in find(docs, "Service")}
    if name == "leaderworkerset":
        [lws] = find(docs, "LeaderWorkerSet")
        set_name, size = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]["size"]
        expected = [f"{set_name}-{g}.{set_name}:50061" if i == 0 else f"{set_name}-{g}-{i}.{set_name}:50061"
                    for g in range(lws["spec"]["replicas"]) for i in range(size)]
        assert tp_size == size
    else:
        [sts] = find(docs, "StatefulSet")
        headless = services[sts["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
        assert selects(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
        expected = [f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}:50061"
                    for i in range(sts["spec"]["replicas"])]
        assert tp_size == 1
    assert addresses == expected


def test_services_and_network_policies_select_the_right_pods(layout):
    _, docs = layout
    pods = {d["metadata"]["name"]: pod for d in docs for pod in pod_specs(d)}
    [scheduler_pod] = [p for p in pods.values() if p["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"]
    worker_pods = [p for p in pods.values() if p["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert worker_pods
    for service in find(docs, "Service"):
        chosen = [p for p in pods.values() if selects(service["spec"]["selector"], p["metadata"]["labels"])]
        assert chosen, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in chosen:
                names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names
    [policy] = find(docs, "NetworkPolicy")
    assert all(selects(policy["spec"]["podSelector"]["matchLabels"], p["metadata"]["labels"]) for p in worker_pods)
    sources = [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert any(selects(s, scheduler_pod["metadata"]["labels"]) for s in sources)
    for pod in worker_pods:
        [worker] = pod["spec"]["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_the_tls_scheduler_differs_from_the_plain_one_only_in_tls():
    [plain] = find(build(K8S), "Deployment", "qwen3-serve-scheduler")
    [tls] = find(build(K8S / "tls"), "Deployment", "qwen3-serve-scheduler")
    plain, tls = copy.deepcopy(plain), copy.deepcopy(tls)
    for doc in (plain, tls):
        spec = doc["spec"]["template"]["spec"]
        container = spec["containers"][0]
        container["args"] = [a for a in container["args"] if not a.startswith("--tls-")]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            for key in ("grpc", "exec", "timeoutSeconds"):
                container[kind].pop(key, None)
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "tls"]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "tls"]
    assert plain == tls


def test_the_optional_gateway_is_valid_and_its_command_line_accepted():
    from gateway.__main__ import build_parser as gateway_parser

    docs = build(K8S / "gateway")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    secrets = {s["metadata"]["name"]: s for s in load(K8S / "secrets.example.yaml")}
    [(_, pod, container, _)] = list(_containers(docs))
    env = container_env(container, docs, {})
    command = [expand(part, env) for part in container["command"] + container.get("args", [])]
    assert command[:3] == ["python", "-m", "gateway"], command
    args = parse_in_env(gateway_parser().parse_args, command[3:], env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and args.host == "0.0.0.0"
    assert args.api_key_file, "the gateway must require API keys"
    for path in (args.api_key_file, args.scheduler_auth_token_file):
        mounted_file(pod, container, path, docs, secrets)
    [scheduler_service] = find(build(K8S), "Service", "qwen3-serve")
    grpc_port = next(p["port"] for p in scheduler_service["spec"]["ports"] if p["name"] == "grpc")
    assert args.target == f"{scheduler_service['metadata']['name']}:{grpc_port}"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["tcpSocket"]["port"] == "http"
    [service] = find(docs, "Service")
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
