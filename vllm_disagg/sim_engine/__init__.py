"""The simulated vLLM engine (same HTTP API and metric names, deterministic output) and simulators."""
