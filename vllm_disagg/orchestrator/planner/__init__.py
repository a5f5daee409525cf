"""The planner: moves instances between the prefill and decode pools as the load moves.

``signals`` turns what the gateway measured (client-visible TTFT and TPOT per request) and what the
registry holds (queues, KV usage) into one figure per pool; ``decide.plan`` is the pure decision (at
most one shift, with its reason and figures, hysteresis, cooldown, minimums, operators' pins);
``runner`` looks every ``interval_s``, carries the decision out through the same role change as
``vllm-disagg role`` (or only explains it, in dry-run), and publishes it (metrics, admin API,
events). docs/planner.md says how to configure and read it.
"""
