"""The replicas' fixtures (tests/integration/orchestrator/replicas/support.py)."""

from tests.integration.orchestrator.replicas.support import etcd, replicas

__all__ = ["etcd", "replicas"]
