"""Fixtures the real-vLLM tests share: the tiny model, and the reference's answers."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from tests.e2e.vllm.reference import Book, run_dir, shared_book


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny offline model (built once, then reused from its directory). Parallel test processes
    take turns: a second builder would replace the directory under the first one's engines."""
    from vllm_disagg.cli.up import tiny_model_dir
    from vllm_disagg.model.tiny import build_tiny_model

    directory = tiny_model_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / f".{directory.name}.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_tiny_model(directory).path


@pytest.fixture(scope="session")
def reference_book(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Book:
    """What one plain colocated vLLM answers to every module's reference cases (reference.py)."""
    return shared_book(tiny_model, run_dir(tmp_path_factory))
