"""The replicated control plane: its election, the replicas' link, and forwarding to the leader."""
