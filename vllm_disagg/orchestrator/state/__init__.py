"""What the orchestrator knows: instances (the registry, the one owner of their state, and its
health rules), the KV index and its prefix index, the KV audit and the event log. Nothing here imports
another part of the orchestrator."""
