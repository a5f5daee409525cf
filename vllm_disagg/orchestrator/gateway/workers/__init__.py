"""Gateway workers (``--gateway-workers N``): N gateway processes on one port, one scheduler state.

The orchestrator process stays the one owner of the state: the registry (sessions, breakers, the KV
audit), the KV index, the event log, request records and the admin API. It serves the gateway itself
(worker 0) and starts N-1 worker processes that bind the same port with ``SO_REUSEPORT``, so the
kernel spreads client connections over N event loops. Each worker runs the same ``Gateway`` code on
replicas: ``RegistryReplica`` (instances, breakers and in-flight counts as the orchestrator last said)
and a ``KvIndex`` fed with the same KV events, in the same order (``hub.WorkerHub`` sends a worker
the whole state when it joins, then deltas every few milliseconds). What changes state (a leg's
outcome for the breakers, a decode leg for the KV audit, a finished request's record, an event) goes
back to the orchestrator; every other path (admin API, ``/metrics``, ``/health``, the dashboard) is
proxied to it, so that a client sees one service whichever process its connection lands on.

The link is a ZeroMQ ROUTER/DEALER pair on an ``ipc://`` socket in a directory only the orchestrator's
user can enter (0700): the frames carry prompts (KV events), and they are pickles of this package's
own messages, which only that user's processes can write (docs/operations.md, "Gateway workers").
"""
