"""A bounded ring of per-request records: where each request went, how long each stage took."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from vllm_disagg.orchestrator.scheduling.framework import Explanation

# Stages of a request's timeline, in the order they happen.
STAGES = (
    "queued",
    "admitted",
    "scheduled",
    "prefill_start",
    "prefill_end",
    "decode_start",
    "first_token",
    "last_token",
)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One engine leg of a request: where it ran and how it ended (``ok``, or the failure's cause)."""

    leg: str  # "prefill" | "decode" | "resume" | "kv_fetch" (a KV pool move to the decode instance)
    instance: str
    started_s: float  # seconds after the request's arrival
    ended_s: float
    outcome: str  # "ok", or an ``UpstreamError`` cause ("connect", "timeout", "status", "lost", ...)
    error: str = ""

    def to_json(self) -> dict[str, object]:
        """The attempt as the admin API shows it."""
        return {
            "leg": self.leg,
            "instance": self.instance,
            "started_s": round(self.started_s, 6),
            "ended_s": round(self.ended_s, 6),
            "outcome": self.outcome,
            "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, for the explanation API."""

    request_id: str  # the gateway's own (``request_ids.py``): its engine legs' id, and its key here
    route: str
    model: str
    mode: str  # "disaggregated", "colocated", or "none" when it failed before scheduling
    prefill: str | None
    decode: str | None
    status: int  # what the client got; 499 when the client went away
    error: str
    started_wall: float
    schedule_s: float  # arrival -> decision (body read, parse, schedule)
    prefill_s: float | None  # the prefill leg
    ttfb_s: float | None  # arrival -> first decode body byte
    total_s: float
    explanation: Explanation | None = None
    # stage (see STAGES) -> seconds after arrival; a stage the request never reached is absent.
    timeline: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    attempts: tuple[Attempt, ...] = ()  # every engine leg, failed ones included, in order
    fallback: str = ""  # why it ran colocated after its prefill legs failed ("" when it did not)
    resumes: int = 0  # times its stream moved to another instance mid-way
    # Why its stream could not have been resumed (its decode engine says no token ids, or left them
    # out), though the request could be: "" when it could, or was not a resumable stream.
    relay: str = ""
    unread_events: int = 0  # events of its stream the gateway could not read, passed on as they came
    # What its decode engine's counters said later: it computed KV it was handed (``kv_audit``).
    kv_check: str = ""
    # Its admission (docs/admission.md): priority, tenant, and ``queued_s`` when it waited.
    admission: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    gateway_s: float | None = None  # the gateway's own time: all of it but the engine legs
    client_request_id: str = ""  # the client's ``X-Request-Id``, if it sent one: a label, not a key


REQUEST_LOG_CAPACITY = 1000  # records each gateway process keeps


class RequestLog:
    """The last ``capacity`` records, addressable by the gateway's request id, or by a client's
    ``X-Request-Id`` (the newest record that carried it: clients may reuse ids, or share them)."""

    def __init__(
        self, capacity: int = 1000, note_elsewhere: Callable[[str, str], None] | None = None
    ) -> None:
        """``note_elsewhere``: told a note for a record this log does not keep (with gateway workers,
        another process may keep it)."""
        self._capacity = capacity
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()
        # client id -> the gateway's id of the newest record with it. Records leave oldest first, so
        # when that one leaves, every older one with the same client id has left before it.
        self._by_client: dict[str, str] = {}
        self.note_elsewhere = note_elsewhere

    def add(self, record: RequestRecord) -> None:
        """Keep a record, forgetting the oldest beyond capacity."""
        records = self._records
        records.pop(record.request_id, None)  # gateway ids are unique: only a test adds one twice
        records[record.request_id] = record
        if record.client_request_id:
            self._by_client[record.client_request_id] = record.request_id
        if len(records) > self._capacity:
            _, gone = records.popitem(last=False)
            client = gone.client_request_id
            if client and self._by_client.get(client) == gone.request_id:
                del self._by_client[client]

    def note_kv_check(self, request_id: str, note: str) -> None:
        """Add a KV audit's finding to a record still kept (it comes after the request ended)."""
        record = self._records.get(request_id)
        if record is not None:
            self._records[request_id] = dataclasses.replace(record, kv_check=note)
        elif self.note_elsewhere is not None:
            self.note_elsewhere(request_id, note)

    def get(self, request_id: str) -> RequestRecord | None:
        """The record of a request, if still kept: by the gateway's id, else the newest by client id."""
        record = self._records.get(request_id)
        if record is None and (own := self._by_client.get(request_id)) is not None:
            record = self._records.get(own)
        return record

    def recent(self, limit: int) -> list[RequestRecord]:
        """The newest ``limit`` records, newest first."""
        out: list[RequestRecord] = []
        for record in reversed(self._records.values()):
            if len(out) >= limit:
                break
            out.append(record)
        return out

    def __len__(self) -> int:
        return len(self._records)
