"""The vLLM plugin on real NIXL: the threads a NIXL agent starts run at the niceness the agent asked for,
on any core, although vLLM on CPU binds the worker that starts them to one.

NIXL 1.5's UCX progress thread polls with a zero timeout and keeps a core busy for as long as its
agent lives (one per engine). Each check runs in a fresh interpreter, as a vLLM worker does, so the
patch never leaks into pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys

from vllm_disagg import jsonutil
from vllm_disagg.agent.vllm_plugin import NIXL_PROGRESS_NICE_ENV

# The niceness of each thread the agent started.
PROBE = """
import os, sys
from vllm_disagg import jsonutil
from vllm_disagg.agent.vllm_plugin import nice_nixl_threads
patched = nice_nixl_threads(int(sys.argv[1])) if sys.argv[1] else False
from nixl._api import nixl_agent, nixl_agent_config

def threads():
    return set(os.listdir("/proc/self/task"))

def stat(tid):
    return open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as vLLM binds its worker to the engine's core
before = threads()
agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
started = sorted(threads() - before)
print(jsonutil.dumps({
    "patched": patched,
    "nice": [int(stat(t)[16]) for t in started],
    "cpus": sorted({len(os.sched_getaffinity(int(t))) for t in started}),
}).decode())
"""


def probe(niceness: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, niceness], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = jsonutil.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_threads_a_nixl_agent_starts_run_at_the_niceness_asked_for() -> None:
    result = probe("19")
    assert result["patched"] is True
    nice = result["nice"]
    assert isinstance(nice, list) and nice and set(nice) == {19}, result  # the progress thread among them
    # Not held to the worker's core: there it would serve transfers only when the worker's own
    # spin-wait yields (after a role swap, a decode's handshake waited minutes for it).
    assert result["cpus"] == [len(os.sched_getaffinity(0))], result


def test_without_the_variable_the_plugin_leaves_nixl_alone() -> None:
    env_free = subprocess.run(
        [sys.executable, "-c", "from vllm_disagg.agent.vllm_plugin import register; register();"
         "import sys; print('nixl._api' in sys.modules)"],
        capture_output=True, text=True, timeout=120, check=True,
        env={k: v for k, v in os.environ.items() if k != NIXL_PROGRESS_NICE_ENV},
    )  # fmt: skip
    assert env_free.stdout.strip() == "False"  # NIXL not even imported
    result = probe("")
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the probe inherits pytest's
    nice = result["nice"]
    assert result["patched"] is False and isinstance(nice, list) and set(nice) == {own}, result
    assert result["cpus"] == [1], result  # left where the worker is
