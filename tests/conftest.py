"""Test-wide configuration.

Every orchestrator the tests start, in-process or as a child (``up``, ``vllm-disagg orchestrator``),
guards its admin API with one known token: children read it from ``VLLM_DISAGG_ADMIN_TOKEN``, as an
operator's would; test code sends ``tests.helpers.ADMIN``.
"""

import os

from tests.helpers import ADMIN_TOKEN
from vllm_disagg.orchestrator.admin.auth import ENV_ADMIN_TOKEN

os.environ[ENV_ADMIN_TOKEN] = ADMIN_TOKEN

# vLLM 0.32 renders a chat template under a 30 s watchdog (a 500 when it fires). The tiny model's
# template renders in milliseconds, so only a frozen machine can fire it: a fresh-clone run that froze
# for 27 s got a 500 from it. No deadline for the engines the tests start (they inherit this
# environment); the product leaves vLLM's default alone.
os.environ["VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT"] = "0"
