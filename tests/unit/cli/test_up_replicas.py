"""``up --replicas N``: what its flags make of the cluster's children (replicas on etcd, the etcd ``up``
starts itself, agents of every replica), what they refuse, and how ``up`` reads who leads."""

from __future__ import annotations

import argparse
import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest

from vllm_disagg.cli import local_etcd
from vllm_disagg.cli.supervise import ChildSpec
from vllm_disagg.cli.up import add_arguments, spec_from_args, supervised_children
from vllm_disagg.cli.up_replicas import Leader, leader_of, port_clash
from vllm_disagg.cli.up_spec import ClusterSpec
from vllm_disagg.errors import ConfigError

ETCD_PORTS = (23790, 23791)  # what the stand-in for "a free port" hands out, in turn
REAL_ETCD_BINARY = local_etcd.etcd_binary


@pytest.fixture(autouse=True)
def no_sockets_no_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The embedded etcd's free ports and binary, without a socket or a PATH lookup; ``up``'s state
    directory in the test's own."""
    ports = itertools.cycle(ETCD_PORTS)
    monkeypatch.setattr(local_etcd, "free_port", lambda host: next(ports))
    monkeypatch.setattr(local_etcd, "etcd_binary", lambda: "/usr/bin/etcd")
    monkeypatch.setenv("VLLM_DISAGG_HOME", str(tmp_path))


def spec_of(*flags: str) -> ClusterSpec:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return spec_from_args(parser.parse_args(["--engine", "sim", "--prefill", "1", "--decode", "1", *flags]))


def flag(argv: tuple[str, ...] | list[str], name: str) -> str:
    return argv[list(argv).index(name) + 1]


def children(*flags: str) -> dict[str, ChildSpec]:
    return {child.name: child for child in supervised_children(spec_of(*flags))}


def test_three_replicas_on_a_given_etcd_each_get_their_ports_id_and_the_shared_etcd_and_cluster() -> None:
    got = children("--replicas", "3", "--etcd", "http://etcd-a:2379, http://etcd-b:2379", "--port", "8000")
    replicas = [got[f"orchestrator replica-{i}"] for i in range(3)]
    assert list(got) == [
        "orchestrator replica-0",
        "orchestrator replica-1",
        "orchestrator replica-2",
        "agent prefill-0",
        "agent decode-0",
    ], "no etcd child: the given one runs already"
    for i, child in enumerate(replicas):
        assert (flag(child.argv, "--port"), flag(child.argv, "--zmq-endpoint")) == (
            str(8000 + i),
            f"tcp://127.0.0.1:{5555 + i}",
        )
        assert (flag(child.argv, "--replica-id"), flag(child.argv, "--cluster")) == (
            f"replica-{i}",
            "up-8000",
        )
        assert flag(child.argv, "--etcd") == "http://etcd-a:2379,http://etcd-b:2379"
        assert flag(child.argv, "--advertise-host") == "127.0.0.1"
        assert flag(child.argv, "--peer-port") == "0", "each picks a free one"
        assert (child.essential, child.group, child.stage) == (True, "orchestrator replicas", 0)
        assert child.last_consequence == "no replica left: stopping the cluster"
    endpoints = ",".join(f"tcp://127.0.0.1:{5555 + i}" for i in range(3))
    for name in ("agent prefill-0", "agent decode-0"):
        assert flag(got[name].argv, "--orchestrator") == endpoints, "every agent talks to every replica"
        assert got[name].stage > 0


@pytest.mark.parametrize("etcd", [[], ["--etcd", "embedded"]], ids=["no-etcd-flag", "etcd-embedded"])
def test_replicas_without_an_etcd_get_one_that_up_starts_first_and_stops_last(
    etcd: list[str], tmp_path: Path
) -> None:
    got = children("--replicas", "2", "--port", "9000", *etcd)
    assert next(iter(got)) == "etcd"
    member = got["etcd"]
    assert member.stage < min(c.stage for name, c in got.items() if name != "etcd")
    assert member.ready is not None, "the replicas start once it is healthy"
    assert not member.essential, "without etcd the replicas still route"
    data_dir = tmp_path / "up-9000" / "etcd"
    assert member.argv[0] == "/usr/bin/etcd"
    assert flag(member.argv, "--data-dir") == str(data_dir), "under up's state directory"
    assert flag(member.argv, "--listen-client-urls") == "http://127.0.0.1:23790"
    assert flag(member.argv, "--listen-peer-urls") == "http://127.0.0.1:23791"
    for i in range(2):
        assert flag(got[f"orchestrator replica-{i}"].argv, "--etcd") == "http://127.0.0.1:23790"


def test_one_replica_or_no_flag_is_the_single_orchestrator_of_before() -> None:
    for flags in ([], ["--replicas", "1"]):
        got = children(*flags)
        assert list(got) == ["orchestrator", "agent prefill-0", "agent decode-0"]
        assert "--etcd" not in got["orchestrator"].argv
        assert got["orchestrator"].essential and got["orchestrator"].group == ""
        assert flag(got["agent decode-0"].argv, "--orchestrator") == "tcp://127.0.0.1:5555"
    assert spec_of("--replicas", "1").replicas is None


def test_one_replica_with_an_etcd_is_a_replicated_cluster_of_one() -> None:
    got = children("--etcd", "http://etcd:2379")
    assert list(got) == ["orchestrator replica-0", "agent prefill-0", "agent decode-0"]
    assert flag(got["orchestrator replica-0"].argv, "--etcd") == "http://etcd:2379"


def test_peer_ports_lease_cluster_and_a_wildcard_host_reach_each_replica() -> None:
    got = children(
        "--replicas", "2", "--etcd", "http://etcd:2379", "--peer-port", "7000", "--lease-ttl-s", "5",
        "--cluster", "lab", "--host", "0.0.0.0",
    )  # fmt: skip
    for i in range(2):
        argv = got[f"orchestrator replica-{i}"].argv
        assert (flag(argv, "--peer-port"), flag(argv, "--lease-ttl-s")) == (str(7000 + i), "5")
        assert (flag(argv, "--cluster"), flag(argv, "--host")) == ("lab", "0.0.0.0")
        assert flag(argv, "--advertise-host") == "127.0.0.1", "a wildcard is not an address to reach"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--replicas", "2", "--etcd", "etcd:2379"], "is not an http(s):// URL"),
        (["--replicas", "2", "--cluster", "no spaces"], "replica.cluster must match"),
        (["--replicas", "2", "--lease-ttl-s", "1"], "replica.lease_ttl_s must be"),
        (
            ["--replicas", "3", "--port", "5554", "--zmq-port", "5555"],
            "port 5555: the replicas' HTTP ports (--port + i) and the agents' ports (--zmq-port + i)",
        ),
        (
            ["--replicas", "2", "--port", "8100", "--engine-base-port", "8101"],
            "port 8101: the replicas' HTTP ports (--port + i) and the engines' ports",
        ),
        (["--replicas", "2", "--peer-port", "65535"], "peer_port"),
    ],
    ids=[
        "no-replicas",
        "etcd-not-a-url",
        "bad-cluster-name",
        "lease-under-etcds-minimum",
        "http-ports-overlap-agents-ports",
        "http-ports-overlap-engine-ports",
        "peer-ports-past-65535",
    ],
)
def test_shapes_that_cannot_work_are_refused_before_anything_starts(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        spec_of(*flags)
    assert message in str(refused.value)


def test_a_missing_etcd_binary_is_refused_naming_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_etcd, "etcd_binary", REAL_ETCD_BINARY)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="etcd-server"):
        spec_of("--replicas", "2")


@pytest.mark.parametrize(
    ("ports", "clash"),
    [
        ({"a": [1, 2], "b": [3]}, ""),
        ({"a": [1, 2], "b": [2, 3]}, "2: a and b"),
        ({"a": [70000]}, "70000: a is not a TCP port"),
        ({"a": [1, 1]}, ""),
    ],
    ids=["apart", "overlapping", "past-65535", "one-use-twice-is-no-clash"],
)
def test_port_clash(ports: dict[str, list[int]], clash: str) -> None:
    assert port_clash(ports) == clash


DESCRIBED: dict[str, Any] = {
    "self": "replica-0",
    "leader": "replica-1",
    "epoch": 12,
    "replicas": [
        {"id": "replica-0", "http": "http://127.0.0.1:8000"},
        {"id": "replica-1", "http": "http://127.0.0.1:8001"},
    ],
}


@pytest.mark.parametrize(
    ("described", "leader"),
    [
        (DESCRIBED, Leader("replica-1", 12, "http://127.0.0.1:8001")),
        ({**DESCRIBED, "leader": None, "epoch": 0}, None),
        ({**DESCRIBED, "epoch": 0}, None),
        ({**DESCRIBED, "replicas": []}, None),  # told with its URL or not at all
        ([], None),
    ],
    ids=["known", "an-election-under-way", "no-term-yet", "leader-not-listed-yet", "not-an-object"],
)
def test_who_leads_is_read_from_the_replicas_answer(described: Any, leader: Leader | None) -> None:
    assert leader_of(described) == leader
