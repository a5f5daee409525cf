"""Where the admin token comes from, how it is checked, and where it never shows."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vllm_disagg.cli.up import ClusterSpec
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import (
    ENV_ADMIN_TOKEN,
    bearer_matches,
    load_admin_token,
    write_admin_token,
)

TOKEN = "a-token-long-enough-0123"


def test_a_file_wins_over_the_environment_and_surrounding_whitespace_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert load_admin_token(str(path), env={ENV_ADMIN_TOKEN: "other-token-from-the-env"}) == TOKEN
    assert load_admin_token("", env={ENV_ADMIN_TOKEN: TOKEN}) == TOKEN
    assert load_admin_token("", env={}) == ""


@pytest.mark.parametrize(
    ("content", "reason"),
    [("", "at least 16"), ("short", "at least 16"), ("two tokens-in-one-file", "without spaces")],
    ids=["empty", "too-short", "with-a-space"],
)
def test_a_token_file_that_will_not_do_is_a_config_error(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match=reason):
        load_admin_token(str(path))


def test_an_unreadable_token_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the admin token file .*missing"):
        load_admin_token(str(tmp_path / "missing"))


def test_a_made_token_is_random_and_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "admin-token"
    first = write_admin_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_admin_token(str(path)) == first
    assert write_admin_token(path) != first


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),
        (f"Bearer {TOKEN[:-1]}", False),
        (f"Bearer {TOKEN}0", False),
        (f"Basic {TOKEN}", False),
        ("Bearer", False),
        (None, False),
    ],
)
def test_only_the_exact_bearer_token_matches(header: str | None, ok: bool) -> None:
    assert bearer_matches(header, TOKEN) is ok
    assert bearer_matches(header, "") is False, "no token configured: nothing matches"


def test_the_token_never_shows_in_a_config_or_cluster_repr() -> None:
    assert TOKEN not in repr(OrchestratorConfig(admin_token=TOKEN))
    spec = ClusterSpec(engine="sim", admin_token=TOKEN)
    assert TOKEN not in repr(spec)
    assert TOKEN not in " ".join(spec.orchestrator_argv()), "never on a command line"
    assert spec.orchestrator_env()[ENV_ADMIN_TOKEN] == TOKEN
