"""The OpenAI-compatible gateway: validation, the P -> D handoff, and byte relaying."""
