"""The ``vllm-disagg`` command: its dispatcher (``commands``), the client-side commands that talk to a
running orchestrator (``admin``: status, drain, role, rollout, ...) and ``up``, a whole local cluster."""
