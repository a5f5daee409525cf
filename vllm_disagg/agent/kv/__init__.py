"""The agent's KV data plane: the node's prefix pool, its shared-memory arena, the connector vLLM
loads, and agent-to-agent transfers (docs/kv-pool.md)."""
