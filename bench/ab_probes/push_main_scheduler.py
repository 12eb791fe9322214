"""A/B probe: push P's scheduler side as it was before design (b) of issue 15 (the scheduler
follows each pushing request's table and pairs it with D's registration,
``TrackerSet.step_pairs``, every step), so the same run compares it with the current one
(spans and vLLM's new ids by reference, the worker following the tables):

    python bench/product_ab.py hma_push_P ab_probes.push_main_scheduler --layouts gptoss dsv4 \
        --requests 256 --prompts 32768 --kinds prefill --variants vllm_nixl_P hma_push_P \
        --steps 120

Scheduler side only: its metadata is the old one (pairs, no new ids), which the current
worker does not read (do not pass ``--worker``). The old scheduler is not copied into the
tree: its source is read from git (commit ``COMMIT``, the last one before design (b), with the
withdrawn-registration fix) and compiled inside its own package, so its relative imports
resolve to today's modules. Needs a git clone (not an sdist).
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any

from hmacore.integrations.vllm import HmaNixlConnector as _Connector
from hmacore.integrations.vllm.nixl.push_scheduler import HmaPushScheduler

COMMIT = "e233ef84"
PATH = "hmacore/integrations/vllm/nixl/push_scheduler.py"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_old() -> type:
    src = subprocess.run(["git", "-C", ROOT, "show", f"{COMMIT}:{PATH}"], check=True,
                         capture_output=True, text=True).stdout
    name = "hmacore.integrations.vllm.nixl._push_scheduler_" + COMMIT
    mod = types.ModuleType(name)
    mod.__package__ = "hmacore.integrations.vllm.nixl"
    sys.modules[name] = mod          # dataclasses and pickling look the module up by name
    exec(compile(src, f"{COMMIT}:{PATH}", "exec"), mod.__dict__)
    return mod.HmaPushScheduler


MainPushScheduler = _load_old()


class HmaNixlConnector(_Connector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if isinstance(self.scheduler, HmaPushScheduler):
            self.scheduler = MainPushScheduler(vllm_config, kv_cache_config)
