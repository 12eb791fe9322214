"""Push producer without the table reservation of each new push request (its table then
grows inside ``TrackerSet.step_pairs``): what the reservation saves in vLLM's Scheduler."""
from __future__ import annotations

from typing import Any

from hmacore.integrations.vllm import HmaNixlConnector as _Connector
from hmacore.integrations.vllm.nixl.push_scheduler import HmaPushScheduler


class NoReservePushScheduler(HmaPushScheduler):
    def _on_followed(self, rid: str, num_prompt_tokens: int) -> None:
        pass


class HmaNixlConnector(_Connector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.scheduler, HmaPushScheduler):
            self.scheduler.__class__ = NoReservePushScheduler
