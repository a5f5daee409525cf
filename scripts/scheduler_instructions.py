"""Instructions one scheduling decision executes, for `scripts/scheduler_instructions.sh`.

Builds `bench scheduler`'s cluster, records 300 decisions of its mix (request and snapshot), then
decides them all again ROUNDS times. The shell script runs this under cachegrind with ROUNDS 1 and 6:
the difference over 1,500 decisions is one decision's count, without the build. A count is what the
code does, not what the machine's neighbours let it do: on a shared virtual machine whose clock
varies by 2x from minute to minute it still tells a 5% change apart (docs/benchmarks.md).

    python scripts/scheduler_instructions.py ROUNDS {decide|snapshot|lookup|decode|prefill} [bench scheduler flags]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from collections import deque

from vllm_disagg.bench import scheduler as bench
from vllm_disagg.orchestrator.scheduling.config import default_config
from vllm_disagg.orchestrator.scheduling.framework import ProfileContext, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens

rounds, part = int(sys.argv[1]), sys.argv[2]
parser = argparse.ArgumentParser()
bench.add_arguments(parser)
args = parser.parse_args(sys.argv[3:])
rng = random.Random(0)
registry, ids, index, docs = bench._cluster(args, rng)
scheduler = PluginScheduler(default_config())
gc.collect()
gc.freeze()
records = []
in_flight: deque[str] = deque()
for n in range(300):
    tokens = bench._prompt(args, docs, rng)
    prompt = PromptTokens(tokens)
    prompt.block_keys(args.block_size)
    snapshot = registry.snapshot()
    request = SchedulingRequest(f"r{n}", bench.MODEL, len(tokens), False, True, index.cached_tokens(prompt), True)
    decision = scheduler.decide(request, snapshot, 0.0)
    bench._load(registry, in_flight, decision.decode)
    records.append((request, snapshot, decision, prompt))
profiles = scheduler._profiles
population = records[0][1].model_ids[bench.MODEL]
for _ in range(rounds):
    for request, snapshot, decision, prompt in records:
        if part == "decide":
            scheduler.decide(request, snapshot, 0.0)
        elif part == "snapshot":  # after a request started and another ended, as between decisions
            registry.acquire(decision.decode)
            registry.release(decision.decode)
            registry.snapshot()
        elif part == "lookup":
            index.cached_tokens(prompt)
        elif part == "decode":
            ctx = ProfileContext(request, snapshot, 0.0, "decode", None)
            profiles["decode"].run(ctx, population, request.exclude)
        else:
            ctx = ProfileContext(request, snapshot, 0.0, "prefill", snapshot.by_id[decision.decode])
            profiles["prefill"].run(ctx, population, request.exclude)
