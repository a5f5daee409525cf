"""A LoRA adapter for the tiny model (``tiny.py``), built offline: what tests of LoRA requests serve.

vLLM keys the blocks of a LoRA request with the adapter (``("lora", name, path)`` in their extra
keys), so the KV pool must keep such blocks apart from the base model's (docs/kv-pool.md). An
adapter with random, seeded weights on the attention's q and v projections changes the KV and the
answers, which makes a block served to the wrong one visible. PEFT's layout (``adapter_config.json``,
``adapter_model.safetensors``), which ``vllm serve --enable-lora --lora-modules NAME=DIR`` loads.

torch and safetensors are imported inside ``build_tiny_lora`` only.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from vllm_disagg import jsonutil
from vllm_disagg.model.tiny import TinyModelSpec

RANK = 8
TARGETS = ("q_proj", "v_proj")
SCALE = 0.5  # wide enough that the adapter's answers differ from the base model's


def build_tiny_lora(out: Path, *, seed: int = 1, spec: TinyModelSpec | None = None) -> Path:
    """Write the adapter into ``out`` (created); same seed and spec, same bytes."""
    spec = spec or TinyModelSpec()
    torch = importlib.import_module("torch")
    save_file = importlib.import_module("safetensors.torch").save_file
    head_dim = spec.hidden_size // spec.num_attention_heads
    outputs = {"q_proj": spec.num_attention_heads * head_dim, "v_proj": spec.num_key_value_heads * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(RANK, spec.hidden_size, generator=generator) * SCALE
            b = torch.randn(outputs[target], RANK, generator=generator) * SCALE
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": "tiny",
    }
    (out / "adapter_config.json").write_bytes(jsonutil.dumps(config))
    return out
