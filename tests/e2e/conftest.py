"""Fixtures the real-vLLM tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny offline model (built once, then reused from its directory)."""
    from vllm_disagg.model.tiny import build_tiny_model
    from vllm_disagg.up import tiny_model_dir

    return build_tiny_model(tiny_model_dir()).path
