"""Test-wide configuration.

Every orchestrator the tests start, in-process or as a child (``up``, ``vllm-disagg orchestrator``),
guards its admin API with one known token: children read it from ``VLLM_DISAGG_ADMIN_TOKEN``, as an
operator's would; test code sends ``tests.helpers.ADMIN``.
"""

import os

from tests.helpers import ADMIN_TOKEN
from vllm_disagg.orchestrator.auth import ENV_ADMIN_TOKEN

os.environ[ENV_ADMIN_TOKEN] = ADMIN_TOKEN
