"""The chaos run's result: counts, recovery counters from the orchestrator, faults, examples.

``resumed``, ``fell_back``, ``retried``, ``recomputed`` and ``kv_audited`` are deltas over the run of
the orchestrator's Prometheus counters (summed over labels); a counter it does not export counts as 0.
With replicas they are summed over the replicas, a replica restarted during the run counted from its
restart (its counters before the kill died with it).

With replicas, ``failed`` splits into ``failed_on_killed_replicas`` (requests in flight on a replica
when it was killed: they die with its connections, nothing can save them) and
``failed_on_live_replicas`` (every other failure); the run is ok when the latter and ``garbled`` are 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# report field -> orchestrator counter
RECOVERY_COUNTERS: dict[str, str] = {
    "resumed": "vllm_disagg_resumes_total",
    "fell_back": "vllm_disagg_fallbacks_total",
    "retried": "vllm_disagg_retries_total",
    # D computed a prompt it was handed (docs/operations.md, "Silent degradation"): simulated engines
    # never do under chaos (their failed pulls answer 500), so any count here is a false alarm.
    "recomputed": "vllm_disagg_kv_recomputed_total",
    "kv_audited": "vllm_disagg_kv_audited_legs_total",  # decode legs judged from engine counters
}
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(\S+)")


def counter_sums(text: str, names: set[str]) -> dict[str, float]:
    """The sum over labels of each metric in ``names`` found in a Prometheus exposition."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match and match.group(1) in sums:
            try:
                sums[match.group(1)] += float(match.group(2))
            except ValueError:
                continue
    return sums


def counter_growth(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> dict[str, int]:
    """Each report field's growth, summed over replicas (one per list entry); a replica whose counter went
    down was restarted: it counts from its restart."""
    growth = dict.fromkeys(RECOVERY_COUNTERS, 0)
    for old, new in zip(before, after, strict=True):
        for name, metric in RECOVERY_COUNTERS.items():
            delta = new[metric] - old[metric]
            growth[name] += int(delta if delta >= 0 else new[metric])
    return growth


async def recovery_counters(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The orchestrator's recovery counters now; all 0 when /metrics cannot be read."""
    names = set(RECOVERY_COUNTERS.values())
    try:
        async with http.get(f"{base_url}/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        text = ""
    return counter_sums(text, names)


@dataclass
class ChaosReport:
    """Everything ``vllm-disagg chaos`` prints."""

    sent: int
    completed: int
    failed: int
    garbled: int
    resumed: int
    fell_back: int
    retried: int
    duration_s: float
    faults: list[dict[str, Any]]
    examples: dict[str, list[dict[str, Any]]]
    abandoned: int = 0
    skipped_faults: int = 0
    recomputed: int = 0
    kv_audited: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    log_file: str = ""
    replicas: int = 0  # orchestrator replicas (0: one orchestrator, no etcd)
    failed_on_killed_replicas: int = 0
    per_replica: dict[str, dict[str, int]] = field(default_factory=dict)  # replica id -> outcome counts

    @property
    def failed_on_live_replicas(self) -> int:
        """Failures no kill of a replica explains."""
        return self.failed - self.failed_on_killed_replicas

    @property
    def rps(self) -> float:
        """Completed requests per second of load."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        """No request failed (with replicas: on a live replica) and none was garbled."""
        return self.failed_on_live_replicas == 0 and self.garbled == 0

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON object."""
        return {
            "sent": self.sent,
            "completed": self.completed,
            "failed": self.failed,
            "garbled": self.garbled,
            "resumed": self.resumed,
            "fell_back": self.fell_back,
            "retried": self.retried,
            "recomputed": self.recomputed,
            "kv_audited": self.kv_audited,
            "duration_s": round(self.duration_s, 3),
            "rps": round(self.rps, 2),
            "abandoned": self.abandoned,
            "faults": self.faults,
            "skipped_faults": self.skipped_faults,
            "examples": self.examples,
            "config": self.config,
            "log_file": self.log_file,
            **(
                {
                    "replicas": self.replicas,
                    "failed_on_killed_replicas": self.failed_on_killed_replicas,
                    "failed_on_live_replicas": self.failed_on_live_replicas,
                    "per_replica": self.per_replica,
                }
                if self.replicas
                else {}
            ),
        }

    def render(self) -> str:
        """A table for people."""
        recovered = sum(1 for f in self.faults if f.get("recovered_s") is not None)
        times = sorted(float(f["recovered_s"]) for f in self.faults if f.get("recovered_s") is not None)
        worst = f", slowest recovery {times[-1]:.1f} s" if times else ""
        lines = [
            f"chaos: {self.duration_s:.1f} s of load, {len(self.faults)} faults "
            f"({recovered} recovered{worst})",
            f"  {'sent':>9} {'completed':>9} {'failed':>7} {'garbled':>7} "
            f"{'resumed':>7} {'fell_back':>9} {'retried':>7} {'rps':>7}",
            f"  {self.sent:>9} {self.completed:>9} {self.failed:>7} {self.garbled:>7} "
            f"{self.resumed:>7} {self.fell_back:>9} {self.retried:>7} {self.rps:>7.1f}",
        ]
        if self.replicas:
            lines.append(
                f"  {self.replicas} replicas: {self.failed_on_killed_replicas} failed on a killed replica's "
                f"connections, {self.failed_on_live_replicas} on live replicas"
            )
        if self.recomputed:
            lines.append(f"  {self.recomputed} decode legs judged to have recomputed their KV (false alarms)")
        if self.abandoned:
            lines.append(f"  {self.abandoned} requests in flight when interrupted (not judged)")
        for f in self.faults:
            outcome = (
                f"back in {f['recovered_s']:.1f} s as pid {f['new_pid']}"
                if f.get("recovered_s") is not None
                else f"NOT RECOVERED: {f.get('error')}"
            )
            lines.append(
                f"  t={f['at_s']:>6.1f}s  SIGKILL {f['kind']:<7} of {f['target']:<10} "
                f"pid {f['pid']}: {outcome}"
            )
        for kind in ("failed", "garbled"):
            for ex in self.examples.get(kind, []):
                lines.append(
                    f"  {kind} {ex['request_id']} {ex['path']} stream={ex['stream']} status={ex['status']} "
                    f"t={ex['at_s']}s: {ex['reason'][:200]}"
                )
        ok = (
            "OK (failed on live replicas == garbled == 0)" if self.replicas else "OK (failed == garbled == 0)"
        )
        lines.append("  verdict: " + (ok if self.ok else "FAILURES"))
        if self.log_file:
            lines.append(f"  cluster logs: {self.log_file}")
        return "\n".join(lines)
