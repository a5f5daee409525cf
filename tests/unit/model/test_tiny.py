"""The tiny offline model: its shape, a deterministic build per seed, and reuse of an existing build.

Building needs torch, transformers and tokenizers (the engine's venv: scripts/setup_engine.sh); those
tests are skipped without them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from vllm_disagg.cli.commands import main
from vllm_disagg.errors import ConfigError
from vllm_disagg.model.tiny import (
    STAMP_FILE,
    WEIGHTS_FILE,
    BuiltModel,
    TinyModelSpec,
    build_tiny_model,
    sha256_file,
)

MISSING = [m for m in ("torch", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
needs_engine_deps = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)}")

# A smaller tokenizer corpus than the default keeps each build to a few seconds on a shared 2-core box;
# the weights do not depend on it.
SPEC = TinyModelSpec(corpus_bytes=512 << 10)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuiltModel:
    return build_tiny_model(tmp_path_factory.mktemp("a") / "tiny", seed=0, spec=SPEC)


@needs_engine_deps
def test_a_fresh_build_writes_a_llama_with_the_documented_shape(built: BuiltModel) -> None:
    config = json.loads((built.path / "config.json").read_text())
    shape = {
        k: config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }
    assert built.built
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert shape == {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
    }
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert built.weights_sha256 == sha256_file(built.path / WEIGHTS_FILE)


@needs_engine_deps
def test_the_tokenizer_is_byte_level_with_a_chat_template(built: BuiltModel) -> None:
    transformers = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(built.path))
    text = "def f(x):\n    return x + 1  # ünïcode"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # bytes round-trip
    assert 1000 < len(tok) <= 2048
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|user|>\nhello\n<|assistant|>\n"


@needs_engine_deps
def test_the_same_seed_gives_identical_weight_bytes(tmp_path: Path, built: BuiltModel) -> None:
    again = build_tiny_model(tmp_path / "tiny", seed=0, spec=SPEC)
    assert again.built
    assert sha256_file(again.path / WEIGHTS_FILE) == built.weights_sha256
    assert (again.path / "tokenizer.json").read_bytes() == (built.path / "tokenizer.json").read_bytes()


@needs_engine_deps
def test_another_seed_gives_other_weights(tmp_path: Path, built: BuiltModel) -> None:
    other = build_tiny_model(tmp_path / "tiny", seed=1, spec=SPEC)
    assert other.weights_sha256 != built.weights_sha256


@needs_engine_deps
def test_a_second_build_with_the_same_seed_reuses_the_directory(built: BuiltModel) -> None:
    weights = built.path / WEIGHTS_FILE
    before = weights.stat().st_mtime_ns
    again = build_tiny_model(built.path, seed=0, spec=SPEC)
    assert (again.built, again.weights_sha256) == (False, built.weights_sha256)
    assert weights.stat().st_mtime_ns == before


@needs_engine_deps
def test_a_build_with_another_seed_replaces_the_previous_one(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    first = build_tiny_model(out, seed=3, spec=SPEC)
    second = build_tiny_model(out, seed=4, spec=SPEC)
    assert second.built and second.weights_sha256 != first.weights_sha256
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name != "tiny"]  # no staging directory left behind


def test_a_directory_the_builder_did_not_make_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="refusing"):
        build_tiny_model(out, seed=0, spec=SPEC)
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.skipif(not MISSING, reason="the engine's dependencies are installed")
def test_the_cli_without_torch_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "tiny", "--out", str(tmp_path / "tiny")]) == 1
    assert "scripts/setup_engine.sh" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


@needs_engine_deps
def test_the_cli_builds_then_reuses_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "tiny", "--out", str(out), "--seed", "5"]) == 0
    assert capsys.readouterr().out.startswith(f"built: {out} (seed 5")
    assert main(["model", "tiny", "--out", str(out), "--seed", "5"]) == 0
    assert capsys.readouterr().out.startswith(f"already built: {out} (seed 5")
