"""``vllm-disagg bench scheduler``: the time of one scheduling decision, prefix lookup included.

Builds, in-process, a registry of N ready instances (half prefill, half decode, metrics drawn at
random) and a KV index holding M instance-blocks, fed through ``KvIndex.apply`` with the same
``KvEvent`` records agents forward. The cached prompts are documents of ``--prompt-blocks`` blocks,
each held by ``--holders`` instances. A decision is what the gateway does per request once the
prompt is tokenized: take the registry snapshot, match the prompt's block keys in the index, and run
the shipped (or given) scheduler config. The keys are hashed with the tokenization (``PromptTokens``:
on the tokenizer's thread for a vLLM model, cached with the ids), so they are timed apart. Requests
are 80% a cached document plus a new question, 20% a cold prompt; the gateway's in-flight counts
move as a concurrency-64 load would.

Tokenization itself is not included (see docs/benchmarks.md for its cost). With
``--heartbeats-per-decision H``, H instances report new metrics between decisions, so the snapshot
is rebuilt inside the timed region as it is in a live cluster.

With ``--links``, every P->D pair has a predicted KV transfer (``LINKS``), so the transfer pairing
runs for every disaggregated decision. With ``--compare``, up to 2,000 of the run's decisions are
made again after it, on the same snapshot and prompt, by the flat scheduler (no shards, every
eligible instance scored) and by the sampled one (no shards, a seeded window): their times, and how
often and by how much their picks differ from the flat one's (``scheduler_variants.py``).

After the run, the machine's pauses are counted, a fixed piece of work of the median decision's length
is timed again and again (the p99 the machine gives any work that long), and the last 2,000 decisions
are replayed, each one's fastest try taken: what of the p99 is the machine's and what is the decision's
(``scheduler_noise.py``).

"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from vllm_disagg import jsonutil
from vllm_disagg.bench.scheduler_noise import Noise, Replay, measure
from vllm_disagg.bench.scheduler_variants import Comparison, Variant, us
from vllm_disagg.orchestrator.scheduling.config import default_config, load_config_file
from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.link_table import LinkTable
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, KvEvent, MetricsSnapshot, Role

MODEL = "bench-model"
CONCURRENCY = 64
# ``--links``: 128 KiB of KV a token, 400 Gbit/s within a domain and 25 Gbit/s across (no link measured
# alone: each pair's tier's typical rate).
LINKS = LinkTable(
    typical=MappingProxyType({"domain": 8 / 400e9, "any": 8 / 25e9}),
    bytes_per_token=MappingProxyType({MODEL: 131072.0}),
)


@dataclass(frozen=True)
class Result:
    """Decision time percentiles, in microseconds."""

    instances: int
    indexed_blocks: int
    decisions: int
    heartbeats_per_decision: int
    keys_p50_us: float  # hashing the prompt's block keys, done with its tokenization
    keys_p99_us: float
    lookup_p50_us: float
    lookup_p99_us: float
    decide_p50_us: float
    decide_p99_us: float
    total_p50_us: float
    total_p99_us: float
    hit_share: float  # decisions whose prefill pick held part of the prompt
    paired_share: float  # decisions for which the transfer pairing weighed pairs (``--links``)
    variants: tuple[Variant, ...] = ()  # with ``--compare``: the shipped one, sampled and flat
    noise: Noise = field(
        default_factory=Noise
    )  # the machine's pauses and the replayed decisions' fastest tries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench scheduler``."""
    parser.add_argument("--instances", type=int, default=1024, help="instances (half prefill, half decode)")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="instance-blocks in the KV index")
    parser.add_argument("--decisions", type=int, default=20_000, help="timed decisions")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-blocks", type=int, default=32, help="blocks of a cached document")
    parser.add_argument("--holders", type=int, default=8, help="instances caching each document")
    parser.add_argument("--heartbeats-per-decision", type=int, default=0, help="registry churn")
    parser.add_argument("--config", default="", help="scheduler YAML (default: the shipped one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domain-size", type=int, default=0, help="instances per domain label (0: none)")
    parser.add_argument("--compare", action="store_true", help="also run the flat and sampled schedulers")
    parser.add_argument(
        "--links",
        action="store_true",
        help="KV transfers predicted for every pair: the transfer pairing runs",
    )
    parser.add_argument(
        "--replays",
        type=int,
        default=5,
        help="decide 2,000 of the decisions again this many times each, fastest try kept (0: no replay)",
    )
    parser.add_argument(
        "--pause-probe-s",
        type=float,
        default=1.0,
        help="seconds counting the machine's pauses, and as many timing a fixed work as long as a decision",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _metrics(rng: random.Random, scraped_at: float) -> MetricsSnapshot:
    # Each heartbeat a new scrape, as an agent sends it: the registry then watches what ends since.
    return MetricsSnapshot(
        scraped_at=scraped_at,
        num_running=rng.randrange(0, 16),
        num_waiting=rng.randrange(0, 4),
        kv_cache_usage=rng.random() * 0.9,
        ttft_s=0.05 + rng.random() * 0.5,
        tpot_s=0.01 + rng.random() * 0.04,
        queue_s=rng.random() * 0.2,
        prefill_tokens_per_s=2000 + rng.random() * 8000,
        mean_prompt_tokens=200 + rng.random() * 800,
    )


def _registry(
    n: int, block_size: int, rng: random.Random, domain_size: int = 0
) -> tuple[Registry, list[str]]:
    registry = Registry(heartbeat_timeout_s=1e9)
    ids = []
    domains = max(1, n // domain_size) if domain_size else 0
    for i in range(n):
        role: Role = "prefill" if i < n // 2 else "decode"
        agent_id = f"{role}-{i}"
        info = InstanceInfo(
            url=f"http://10.0.{i // 250}.{i % 250}:8000",
            role=role,
            model=MODEL,
            block_size=block_size,
            kv_connector="NixlConnector",
            labels={"domain": f"nvl-{i % domains}"} if domains else {},  # P's and D's in every domain
        )
        registry.hello(agent_id, info, 0.0)
        registry.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready", metrics=_metrics(rng, 1.0)), 0.0)
        ids.append(agent_id)
    return registry, ids


def _documents(
    args: argparse.Namespace, ids: list[str], rng: random.Random
) -> tuple[KvIndex, list[list[int]]]:
    index = KvIndex()
    bs, nblocks = args.block_size, args.prompt_blocks
    count = max(1, args.blocks // (nblocks * args.holders))
    docs = []
    for _ in range(count):
        tokens = [rng.randrange(50_000) for _ in range(nblocks * bs)]
        docs.append(tokens)
        for holder in rng.sample(ids, min(args.holders, len(ids))):
            hashes = [rng.getrandbits(63) for _ in range(nblocks)]
            index.apply(holder, [KvEvent("stored", hashes, None, tokens, bs)])
    return index, docs


def _cluster(
    args: argparse.Namespace, rng: random.Random
) -> tuple[Registry, list[str], KvIndex, list[list[int]]]:
    """The registry, its instances' ids, the KV index and the cached documents."""
    registry, ids = _registry(args.instances, args.block_size, rng, args.domain_size)
    if args.links:
        registry._use_links(LINKS)  # as learned from transfers (link_rates), without the transfers
    index, docs = _documents(args, ids, rng)
    return registry, ids, index, docs


def run_bench(args: argparse.Namespace) -> Result:
    """Build the cluster picture, then time ``--decisions`` decisions."""
    rng = random.Random(args.seed)
    registry, ids, index, docs = _cluster(args, rng)
    config = load_config_file(args.config) if args.config else default_config()
    scheduler, compare = PluginScheduler(config), Comparison(config, args.decisions) if args.compare else None
    gc.collect()  # and freeze, as the orchestrator does once started: collections never walk the index
    gc.freeze()
    in_flight: deque[str] = deque()
    replay = Replay(args.decisions)
    keys, lookup, decide, total = [], [], [], []
    hits = paired = 0
    perf = time.perf_counter
    for n in range(args.decisions + 200):
        _churn(registry, ids, rng, args.heartbeats_per_decision, n)
        tokens = _prompt(args, docs, rng)
        tk = perf()
        prompt = PromptTokens(tokens)
        prompt.block_keys(args.block_size)
        t0 = perf()
        snapshot = registry.snapshot()
        cached = index.cached_tokens(prompt)
        t1 = perf()
        request = SchedulingRequest(f"r{n}", MODEL, len(tokens), False, True, cached, True)
        ta = perf()
        decision = scheduler.decide(request, snapshot, 0.0)
        t2 = perf()
        if compare is not None and n >= 200:
            compare.after(n - 200, request, snapshot, decision, t2 - ta, t1 - t0)
        _load(registry, in_flight, decision.decode)
        if n < 200:  # warm-up
            continue
        keys.append(t0 - tk)
        lookup.append(t1 - t0)
        decide.append(t2 - ta)
        total.append(t2 - ta + t1 - t0)
        hits += decision.prefill is not None and cached.get(decision.prefill, 0) > 0
        replay.record(n - 200, prompt, request, snapshot)
        paired += getattr(decision.explanation, "pairs", None) is not None
    variants = compare.results() if compare is not None else ()
    return Result(
        instances=args.instances,
        indexed_blocks=sum(index.blocks_of(i) for i in ids),
        decisions=args.decisions,
        heartbeats_per_decision=args.heartbeats_per_decision,
        keys_p50_us=us(keys, 50),
        keys_p99_us=us(keys, 99),
        lookup_p50_us=us(lookup, 50),
        lookup_p99_us=us(lookup, 99),
        decide_p50_us=us(decide, 50),
        decide_p99_us=us(decide, 99),
        total_p50_us=us(total, 50),
        total_p99_us=us(total, 99),
        hit_share=round(hits / max(1, args.decisions), 3),
        paired_share=round(paired / max(1, args.decisions), 3),
        variants=variants,
        noise=measure(
            replay, scheduler, index, args.replays, args.pause_probe_s, us(total, 50) if total else 0.0
        ),
    )


def _churn(registry: Registry, ids: list[str], rng: random.Random, count: int, n: int) -> None:
    """``count`` instances drawn at random report a new scrape before decision ``n``."""
    for _ in range(count):
        agent_id = ids[rng.randrange(len(ids))]
        metrics = _metrics(rng, 2.0 + n)
        registry.heartbeat(agent_id, Heartbeat(seq=2 + n, engine_state="ready", metrics=metrics), 0.0)


def _load(registry: Registry, in_flight: deque[str], decode: str) -> None:
    """The decision's request goes in flight on its decode instance; the oldest of a concurrency-64
    load ends."""
    registry.acquire(decode)
    in_flight.append(decode)
    if len(in_flight) > CONCURRENCY:
        registry.release(in_flight.popleft())


def _prompt(args: argparse.Namespace, docs: list[list[int]], rng: random.Random) -> list[int]:
    """80%: a cached document and a new question; 20%: a cold prompt of the same length."""
    if rng.random() < 0.8:
        return docs[rng.randrange(len(docs))] + [rng.randrange(50_000) for _ in range(24)]
    return [rng.randrange(50_000) for _ in range(args.prompt_blocks * args.block_size + 24)]


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON)."""
    result = run_bench(args)
    if args.json:
        print(jsonutil.dumps(asdict(result)).decode())
        return 0
    print(
        f"instances {result.instances}, indexed instance-blocks {result.indexed_blocks:,}, "
        f"{result.decisions:,} decisions, {result.heartbeats_per_decision} heartbeats per decision"
    )
    print("| part | p50 µs | p99 µs |")
    print("|---|---|---|")
    print(f"| (block keys, hashed with the tokenization) | {result.keys_p50_us} | {result.keys_p99_us} |")
    print(f"| snapshot + prefix lookup | {result.lookup_p50_us} | {result.lookup_p99_us} |")
    print(f"| profiles + decider | {result.decide_p50_us} | {result.decide_p99_us} |")
    print(f"| decision (total) | {result.total_p50_us} | {result.total_p99_us} |")
    print(f"prefill picks holding part of the prompt: {result.hit_share:.1%} of decisions (80% were cached)")
    noise = result.noise
    if noise.pauses_per_s:
        hit = noise.pauses_per_s * result.total_p50_us / 1e6
        print(
            f"machine: {noise.pauses_per_s:g} pauses/s of {noise.pause_median_us} µs median "
            f"(one lands in {hit:.1%} of {result.total_p50_us} µs decisions)"
        )
    if noise.steady_p50_us:
        ratio = noise.steady_p99_us / noise.steady_p50_us
        print(
            f"machine: the same work every time, sized to the median decision: p50 {noise.steady_p50_us} / "
            f"p99 {noise.steady_p99_us} µs (its own p99 is {ratio:.2f}x its p50)"
        )
    if noise.replayed:
        print(
            f"{noise.replayed:,} decisions replayed {args.replays} times, fastest try each "
            f"(lookup + decide, warm): p50 {noise.replay_p50_us} / p99 {noise.replay_p99_us} µs"
        )
    if result.paired_share:
        print(f"P and D paired counting the KV transfer: {result.paired_share:.1%} of decisions")
    if result.variants:
        print()
        print(
            "| scheduler | decide p50 / p99 µs | decision p50 / p99 µs | P picks not flat's | D picks not "
            "flat's | predicted TTFT vs flat, mean / p99 ms | predicted TPOT vs flat, mean / p99 ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for v in result.variants:
            print(
                f"| {v.name} | {v.decide_p50_us} / {v.decide_p99_us} | {v.total_p50_us} / {v.total_p99_us} | "
                f"{v.prefill_differs:.1%} | {v.decode_differs:.1%} | {v.ttft_worse_mean_ms:+.2f} / "
                f"{v.ttft_worse_p99_ms:+.2f} | {v.tpot_worse_mean_ms:+.2f} / {v.tpot_worse_p99_ms:+.2f} |"
            )
    return 0
