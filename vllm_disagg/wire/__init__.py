"""vLLM's wire formats, one home for everyone who speaks them: the agent (which reads a real engine's
KV events), the orchestrator (which builds and forwards ``kv_transfer_params``), the simulated engine
(which must produce both exactly as vLLM does) and the cluster simulator.

Nothing here imports above ``vllm_disagg.errors``; ``tests/unit/test_layers.py`` keeps it so.
"""
