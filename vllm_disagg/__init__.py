"""vllm-disagg: the control plane for disaggregated prefill/decode serving on vLLM."""

__version__ = "0.1.0"
