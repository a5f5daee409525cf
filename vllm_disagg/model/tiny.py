"""``vllm-disagg model tiny``: build a tiny random-weight Llama that real vLLM can serve, offline.

No model can be downloaded in CI, so tests build one: a byte-level BPE tokenizer trained on the Python
standard library's sources (fixed sorted order) and a 2-layer Llama with seeded normal(0, 0.2) weights,
so greedy output is varied yet identical on every run. Same seed, same spec: same weight bytes. A stamp
file makes a second build into the same directory a no-op.

torch, transformers and tokenizers are imported inside ``build_tiny_model`` only: the orchestrator and
the agents never load them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.errors import ConfigError

BUILDER_VERSION = 1  # bump when the output for a given seed and spec changes
STAMP_FILE = "vllm-disagg-tiny.json"
WEIGHTS_FILE = "model.safetensors"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# A plain template so /v1/chat/completions works: one "<|role|>" line per message, then the content.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """The model's shape; head_dim 32 is one the CPU attention backend accepts."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    init_std: float = 0.2  # wide enough that greedy decoding does not repeat one token
    corpus_bytes: int = 4 << 20  # of stdlib sources the tokenizer is trained on

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("tiny.hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("tiny.num_attention_heads must be a multiple of num_key_value_heads")
        for name, value in asdict(self).items():
            if not value > 0:
                raise ConfigError(f"tiny.{name} must be > 0, got {value}")


@dataclass(frozen=True)
class BuiltModel:
    """A tiny model directory and how it came to be."""

    path: Path
    seed: int
    weights_sha256: str
    built: bool  # False: a build with the same seed and spec was already there


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(seed: int, spec: TinyModelSpec) -> dict[str, Any]:
    return {"builder": BUILDER_VERSION, "seed": seed, "spec": asdict(spec)}


def existing_build(out: Path, seed: int, spec: TinyModelSpec) -> BuiltModel | None:
    """The model already in ``out`` if it was built with this seed and spec and its weights are intact."""
    try:
        stamp = jsonutil.loads((out / STAMP_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or {k: stamp.get(k) for k in ("builder", "seed", "spec")} != _stamp(
        seed, spec
    ):
        return None
    weights = out / WEIGHTS_FILE
    if not weights.is_file() or sha256_file(weights) != stamp.get("weights_sha256"):
        return None
    return BuiltModel(path=out, seed=seed, weights_sha256=str(stamp["weights_sha256"]), built=False)


def corpus_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted: the same order on every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def corpus(limit_bytes: int) -> Iterator[str]:
    """Texts to train the tokenizer on, up to ``limit_bytes`` in all."""
    left = limit_bytes
    for path in corpus_files():
        if left <= 0:
            return
        data = path.read_bytes()[:left]
        left -= len(data)
        yield data.decode("utf-8", errors="replace")


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    tokenizers = importlib.import_module("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec.corpus_bytes), trainer=trainer)
    return tok


def _write_model(out: Path, seed: int, spec: TinyModelSpec) -> None:
    """Tokenizer and weights into ``out`` (an empty directory)."""
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))

    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,  # not the tokenizer's count: the weights must not depend on the corpus
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    # Our own pass in name order with our own generator: the bytes must not depend on how a given
    # transformers version initialises modules. Norm weights keep their ones.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.normal_(0.0, spec.init_std, generator=generator)
    model.save_pretrained(str(out), safe_serialization=True)


def _check_replaceable(out: Path) -> None:
    """Refuse to replace anything but nothing, an empty directory, or a previous build."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / STAMP_FILE).exists())):
        raise ConfigError(f"{out} exists and is not a tiny model directory; refusing to overwrite it")


def build_tiny_model(out: Path, *, seed: int = 0, spec: TinyModelSpec | None = None) -> BuiltModel:
    """Build the tiny model into ``out``, or reuse the one there if built with the same seed and spec."""
    spec = spec or TinyModelSpec()
    out = Path(out)
    found = existing_build(out, seed, spec)
    if found is not None:
        return found
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and move it in whole: an interrupted build never looks finished.
    staging = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_model(staging, seed, spec)
        digest = sha256_file(staging / WEIGHTS_FILE)
        (staging / STAMP_FILE).write_bytes(jsonutil.dumps({**_stamp(seed, spec), "weights_sha256": digest}))
        _check_replaceable(out)  # again: it may have changed during the build
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return BuiltModel(path=out, seed=seed, weights_sha256=digest, built=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``model tiny`` flags."""
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="weights seed: same seed, same bytes")


def run(args: argparse.Namespace) -> int:
    """Build (or reuse) the model and print where it is."""
    started = time.monotonic()
    try:
        model = build_tiny_model(args.out, seed=args.seed)
    except ModuleNotFoundError as exc:
        print(
            f"vllm-disagg model tiny: {exc.name} is not installed; run scripts/setup_engine.sh VENV first",
            file=sys.stderr,
        )
        return 1
    verb = "built" if model.built else "already built"
    print(
        f"{verb}: {model.path} (seed {model.seed}, weights sha256 {model.weights_sha256}) "
        f"in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    return 0
