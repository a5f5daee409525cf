"""Secrets and sockets stay this user's: files 0600 from their creation, directories 0700 and owned,
stale keys gone, shared-memory names nobody can guess, grant tokens out of logs."""

from __future__ import annotations

import os
import re
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_disagg.agent.kv.arena import Capacity, Geometry
from vllm_disagg.agent.kv.local import local_endpoint, make_local_dir
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.cli.up import with_keys
from vllm_disagg.cli.up_spec import ClusterSpec
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import write_admin_token
from vllm_disagg.private_files import mask, private_dir, runtime_dir, write_private
from vllm_disagg.protocol.commands import KvFetch, KvGrant
from vllm_disagg.protocol.curve import load_agent_keys, load_keypair, make_keypair


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def no_umask_no_chmod(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A umask that hides nothing, and ``chmod`` of files recorded but not done: a secret file must
    be private by how it was created, never by a ``chmod`` after it was written."""
    chmods: list[str] = []
    real_chmod = os.chmod

    def chmod(path: str | os.PathLike[str], m: int, **kwargs: object) -> None:
        if os.path.isdir(path):
            real_chmod(path, m)
        else:
            chmods.append(str(path))

    monkeypatch.setattr(os, "chmod", chmod)
    old = os.umask(0)
    try:
        yield chmods
    finally:
        os.umask(old)


def test_a_keypair_secret_is_0600_from_its_creation_in_a_0700_directory(
    tmp_path: Path, no_umask_no_chmod: list[str]
) -> None:
    _, secret = make_keypair(tmp_path / "keys", "agent-0")
    assert mode(secret) == 0o600
    assert mode(tmp_path / "keys") == 0o700
    assert no_umask_no_chmod == []
    assert load_agent_keys(str(tmp_path / "keys")) == {load_keypair(str(secret)).public: "agent-0"}


def test_the_admin_token_is_0600_from_its_creation_and_replaces_a_looser_file(
    tmp_path: Path, no_umask_no_chmod: list[str]
) -> None:
    path = tmp_path / "up-8000" / "admin-token"
    path.parent.mkdir()
    path.write_text("old\n")  # 0666 under this umask
    token = write_admin_token(path)
    assert path.read_text() == token + "\n"
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700


def test_a_private_write_does_not_follow_a_symbolic_link_planted_in_its_place(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep me")
    link = tmp_path / "secret"
    link.symlink_to(target)
    write_private(link, b"secret")
    assert target.read_text() == "keep me"
    assert not link.is_symlink() and link.read_bytes() == b"secret" and mode(link) == 0o600


def test_a_private_directory_is_tightened_when_ours_and_refused_when_another_users_or_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    assert private_dir(loose) == loose and mode(loose) == 0o700
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(ConfigError, match="not a symbolic link"):
        private_dir(link)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(theirs).st_uid + 1)  # as another user sees it
    with pytest.raises(ConfigError, match="belongs to uid"):
        private_dir(theirs)


def test_the_agents_runtime_directory_is_refused_when_another_user_made_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = local_endpoint("decode-0", str(tmp_path))
    made_first = Path(endpoint.removeprefix("ipc://")).parent
    made_first.mkdir(mode=0o777)
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(made_first).st_uid + 1)
    with pytest.raises(ConfigError, match="belongs to uid"):
        make_local_dir(endpoint)


def test_the_runtime_directory_is_xdg_runtime_dir_where_the_system_gives_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == tmp_path / "vllm-disagg"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir().name == f"vllm-disagg-{os.getuid()}"
    assert runtime_dir(str(tmp_path)) == tmp_path / f"vllm-disagg-{os.getuid()}"


def test_up_admits_only_this_runs_agents_a_key_of_an_earlier_larger_run_is_removed(tmp_path: Path) -> None:
    make_keypair(tmp_path / "keys" / "agents", "decode-7")  # from a 4P8D run
    spec = with_keys(ClusterSpec(prefill=1, decode=1), tmp_path / "keys")
    admitted = sorted(load_agent_keys(str(Path(spec.keys_dir) / "agents")).values())
    assert admitted == sorted(plan.agent_id for plan in spec.plans())
    assert "decode-7" not in admitted
    assert mode(tmp_path / "keys") == mode(tmp_path / "keys" / "agents") == 0o700


def test_a_pools_shared_memory_name_cannot_be_predicted_from_the_agent_and_its_pid() -> None:
    name = f"vllm-disagg-test-{uuid.uuid4().hex}"
    nodes = [PoolNode(name, Capacity.parse("10%"), memory_bytes=2**20) for _ in range(2)]
    try:
        paths = [n.open(Geometry(num_layers=1, layer_block_bytes=4096, block_size=16)).path for n in nodes]
    finally:
        for n in nodes:
            n.close()
    assert paths[0] != paths[1]
    for path in paths:
        assert re.fullmatch(rf"{name}-{os.getpid()}-[0-9a-f]{{16}}", path.name)


def test_grant_tokens_are_in_no_repr_and_masked_to_a_digest() -> None:
    token = "a-grant-token-of-some-length"
    grant = KvGrant(token, [b"k"], "", 30.0)
    fetch = KvFetch(token, [b"k"], "tcp://127.0.0.1:1", "", 2.0)
    assert token not in repr(grant) and token not in repr(fetch)
    assert token not in mask(token) and mask(token) == mask(token) != mask(token + "x")
