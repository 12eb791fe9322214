"""Cost probe of design (b) for the push producer (NOT a working push): P's scheduler side
follows no table and pairs nothing; each step's ``PushSave`` carries the request's token span
and vLLM's new-id lists by reference (P's worker would append them to its own table and pair
them with D's registration, which it already holds). What is left is the scheduler-side cost
that design would have: finding the pushing requests' entries and their spans."""
from __future__ import annotations

from typing import Any

from hmacore.integrations.vllm import HmaNixlConnector as _Connector
from hmacore.integrations.vllm import _compat as C
from hmacore.integrations.vllm.nixl.push_metadata import PushSave
from hmacore.integrations.vllm.nixl.push_scheduler import HmaPushScheduler


class SpanOnlyPushScheduler(HmaPushScheduler):
    def _pushing(self) -> dict[str, None]:
        return self.__dict__.setdefault("_span_pushing", {})

    def _follow_from_output(self, rid: str, num_prompt_tokens: int) -> None:
        self._pushing()[rid] = None

    def _unfollow(self, rid: str) -> None:
        self._pushing().pop(rid, None)

    def _push_plan(self, scheduler_output: Any) -> dict[str, PushSave]:
        pushing = self._pushing()
        if not pushing:
            return {}
        saves: dict[str, PushSave] = {}
        num_sched = scheduler_output.num_scheduled_tokens
        steps = self._push_steps
        for rid, ids, _full in C.scheduled_entries(scheduler_output, list(pushing)):
            entry = self._push_reqs.get(rid)
            if entry is None or rid in self._unpushed or rid in self._push_ended:
                continue
            request, pid = entry
            count = num_sched.get(rid, 0)
            if pid not in self._registered or count <= 0:
                continue
            total = request.num_prompt_tokens
            step = steps.get(rid, 0)
            computed = request.num_computed_tokens
            start = 0 if step == 0 else computed
            end = min(computed + count, total)
            if start >= end:
                continue
            final = end >= total
            saves[rid] = PushSave(request_id=rid, push_id=pid, step=step,
                                  local_block_ids=ids, remote_block_ids=[], final=final,
                                  regrain=([start], [end], [], []))
            steps[rid] = step + 1
            if final:
                del pushing[rid]
        return saves


class HmaNixlConnector(_Connector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.scheduler, HmaPushScheduler):
            self.scheduler.__class__ = SpanOnlyPushScheduler
