"""Push producer that also allocates two int32 arrays (1008 and 505 entries, the sizes of a
gpt-oss step's flattened new ids and their offsets) in every step that pushes: the in-situ
cost of one numpy allocation on the scheduler's hot path."""
from __future__ import annotations

from typing import Any

import numpy as np

from hmacore.integrations.vllm import HmaNixlConnector as _Connector
from hmacore.integrations.vllm.nixl.push_scheduler import HmaPushScheduler


class ExtraAllocPushScheduler(HmaPushScheduler):
    def _push_plan(self, scheduler_output: Any) -> Any:
        saves = super()._push_plan(scheduler_output)
        if saves:
            self._probe = (np.empty(1008, dtype=np.int32), np.empty(505, dtype=np.int32))
        return saves


class HmaNixlConnector(_Connector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.scheduler, HmaPushScheduler):
            self.scheduler.__class__ = ExtraAllocPushScheduler
