"""Scheduler <-> worker payloads of :class:`HmaNixlConnector` in layer-wise push mode
(``kv_connector_extra_config: {"transfer_mode": "push"}``).

Decode first: D's scheduler hands its workers a :class:`PushRegistration` (D's per-group block
ids); each D worker (TP rank) sends it to every P rank as a NIXL notification; each P worker
reports it to P's scheduler (:class:`HmaPushWorkerMeta`, once the D ranks it writes to all
registered); P's scheduler then puts one :class:`PushSave` per scheduled push
request into each step's metadata (its token span and vLLM's new block ids); P's worker
follows the request's table from them, pairs it with D's registration and WRITEs each layer
as soon as it is computed.

Units: block ids are per KV cache group (blocks of that group, vLLM group order); a
*positional* table has one entry per block position of the request (position p holds tokens
``[p * block_size, (p + 1) * block_size)``), 0 (vLLM's null block) where nothing is
transferred; token counts are tokens. Everything is plain lists (pickle/msgspec friendly).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .metadata import HmaNixlConnectorMetadata, HmaNixlWorkerMeta

__all__ = ["TRANSFER_MODES", "PUSH_AGENT_SUFFIX", "PushRegistration", "PushSave",
           "HmaPushConnectorMetadata", "HmaPushWorkerMeta", "check_push_id"]

TRANSFER_MODES = ("pull", "push")
#: NIXL agent names of push-mode engines end with this, so a handshake reveals the peer's mode.
PUSH_AGENT_SUFFIX = "@push"


def check_push_id(value: Any) -> str:
    """``push_id`` rule: a non-empty string without ``:`` (it prefixes NIXL notifications) or
    ``@`` (``<push_id>@<rank>`` tags a prefill rank's pushes), at most 256 characters. Raises
    ValueError naming the field and the rule."""
    if not isinstance(value, str) or not value or ":" in value or "@" in value \
            or len(value) > 256:
        raise ValueError(f"kv_transfer_params.push_id must be a non-empty string of at most "
                         f"256 characters without ':' or '@', got {value!r}")
    return value


@dataclasses.dataclass
class PushRegistration:
    """D scheduler -> D worker: register ``request_id``'s blocks with prefill peer ``host:port``.

    ``block_ids``: D's positional table per group (covering ``num_tokens`` tokens), window /
    state clipped, 0 at positions P must not write (outside the window, local prefix hit,
    null). ``awaiting``: the request waits in WAITING_FOR_REMOTE_KVS for the push (False: a
    full local hit, the registration only lets P proceed).
    """

    request_id: str
    push_id: str
    host: str
    port: int
    block_ids: list[list[int]]
    num_tokens: int
    awaiting: bool = True
    start_tokens: int = 0     # D's local hit: the first token P writes (a block-size remap)


@dataclasses.dataclass
class PushSave:
    """P scheduler -> P worker: this step of one push request (design (b) of issue 15: the
    scheduler follows no table; the worker does).

    ``start``, ``end``: the tokens ``[start, end)`` whose KV this step writes (every token up
    to the step's end in step 0, so a local prefix hit on P is pushed too). ``new_block_ids``:
    the request's entry of vLLM's scheduler output, passed as vLLM built it (one id list per
    group, or None: no new block): its new blocks, or its whole table when ``full`` (its
    first scheduled step; a request resumed after a preemption, whose table then replaces
    the worker's). ``step``: 0, 1, ... per request; ``final``: the prompt's last step (after
    it every layer's notification and ``done`` go to D).

    Filled by P's worker when it plans the step (:meth:`HmaPushWorker._plan_step`), never
    sent: ``local_block_ids[g][i]`` (P's block) goes to ``remote_block_ids[g][i]`` (D's
    block), the block positions of the step's tokens with a null id on either side left
    out, one int32 array per group; ``regrain``: a block-size remap (D's blocks of another
    size), ``(lo, hi, local_first, remote_first)`` per group, the ids then being each side's
    blocks holding tokens ``[lo, hi)`` (entry i is that side's block ``first + i``), Mamba
    groups paired state blocks (:meth:`hmacore.regrain.RegrainPlan.runs`): none before the
    prompt's last step, then P's state block at its state point and D's registered slot.
    """

    request_id: str
    push_id: str
    step: int
    final: bool
    start: int = 0
    end: int = 0
    new_block_ids: Any = None
    full: bool = False
    local_block_ids: list[Any] = dataclasses.field(default_factory=list)
    remote_block_ids: list[Any] = dataclasses.field(default_factory=list)
    regrain: tuple[list[int], list[int], list[int], list[int]] | None = None


@dataclasses.dataclass
class HmaPushConnectorMetadata(HmaNixlConnectorMetadata):
    """Per-step metadata in push mode (the pull fields keep their meaning; unused ones stay
    empty). ``push_regs``: D side, request id -> registration to send. ``push_saves``: P side,
    request id -> this step's WRITEs. ``push_aborts``: P side, push ids whose request was
    aborted (stop pushing, tell D it failed)."""

    push_regs: dict[str, PushRegistration] = dataclasses.field(default_factory=dict)
    push_saves: dict[str, PushSave] = dataclasses.field(default_factory=dict)
    push_aborts: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class HmaPushWorkerMeta(HmaNixlWorkerMeta):
    """Worker -> scheduler: ``registered`` push id -> the prefill TP ranks that reported it
    registered, new since the last report (a rank reports a push once every decode rank that
    reads from it registered; D's table and any block-size remap stay on the worker, which
    plans the steps). vLLM's KVOutputAggregator folds the ranks' reports with
    :meth:`aggregate` (rank lists are united); P's scheduler starts a push once every rank of
    its engine reported it."""

    registered: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: D: request id -> decode ranks that cancelled its push and hold its blocks until the
    #: prefill side acknowledges; ``released``: ranks whose hold ended (pinned blocks free)
    holding: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    released: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: P: push ids a rank reported in ``registered`` whose decode side cancelled them before
    #: any WRITE (P's scheduler forgets them: a request that comes later is not pushed)
    withdrawn: set[str] = dataclasses.field(default_factory=set)

    def aggregate(self, other: Any) -> HmaPushWorkerMeta:
        def unite(name: str) -> dict[str, list[int]]:
            by = {k: list(v) for k, v in getattr(self, name).items()}
            for key, ranks in (getattr(other, name, None) or {}).items():
                by[key] = sorted(set(by.get(key, ())) | set(ranks))
            return by
        return HmaPushWorkerMeta(renewed=set(self.renewed) | set(getattr(other, "renewed", ())),
                                 registered=unite("registered"),
                                 holding=unite("holding"), released=unite("released"),
                                 withdrawn=set(self.withdrawn) | set(
                                     getattr(other, "withdrawn", None) or ()))
