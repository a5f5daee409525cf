"""etcd for the replicated control plane: a client over etcd's JSON gateway, leader election with
fencing epochs, and replica membership (docs/etcd.md).

A bottom-layer package: it imports only the package's plain utilities (``errors``, ``clock``,
``jsonutil``), the standard library and aiohttp.
"""

from vllm_disagg.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    WatchCanceled,
    WatchEvent,
)
from vllm_disagg.etcd.election import Election, Leader
from vllm_disagg.etcd.members import Member, Members

__all__ = [
    "Election",
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "KeyValue",
    "Leader",
    "Member",
    "Members",
    "WatchCanceled",
    "WatchEvent",
]
