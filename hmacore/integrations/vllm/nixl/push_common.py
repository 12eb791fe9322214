"""Shared pieces of the push worker (:mod:`.push_worker`): the notification keywords, the
timing constants, the tag of a push's notifications, the RegrainPlan a prefill rank builds
per decode rank, and the per-push records each side keeps (D: :class:`_Source`,
:class:`_Cancel`; P: :class:`_Reg`, :class:`_Push`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ....errors import BlockTableError, HandshakeError, LayoutError
from ....regrain import RegrainPlan
from ....tables import from_wire
from ._regrain import check_push_mamba, regrain_plan

#: D's first handshake with a prefill engine: P's side adds D's agent to NIXL while D waits,
#: which on a loaded host can take several seconds the first time (5 s timed out in CI)
FIRST_CONTACT_TIMEOUT_S = 30.0
#: D pings each prefill engine it awaits a push from this often (seconds): NIXL reports a dead
#: peer's agent at the next send, so a push from a killed prefill fails within about this
#: interval instead of at push_recv_timeout
PEER_CHECK_INTERVAL_S = 0.5

_REG = b"REG:"
_PING = b":PING"         # D -> P liveness probe (no push id); P drops it
_CANCEL = b"CANCEL:"     # D -> P "<push_id>:CANCEL:<D agent>": D gave up on that push
_CANCELLED = b"CANCELLED:"   # P -> D "<push_id>:CANCELLED:<P agent>": no WRITE of it in flight


def _regrain_plan_with(src_layout: Any, src_plan: Any, src_pages: Any, dst_layout: Any,
                       dst_plan: Any, dst_pages: Any, mapping: Any, src_rank: int, who: str,
                       log: bool = True, state: Any = None, src_state: Any = "state") -> Any:
    """The RegrainPlan P rank ``src_rank`` -> one D rank (``mapping``: that D rank's
    TpMapping at other TP sizes, else None). ``state``: per group the destination's Mamba
    state bytes (:func:`~._regrain.state_bytes`); ``src_state``: the source's, default
    ``state`` (equal TP sizes: P checks D's registration carries equal ones before any WRITE,
    :meth:`HmaPushWorker._state_mismatch`; other TP sizes: each side's own bytes and the
    other's from the state geometry, :func:`~._tp.state_bytes_at`, the plan pairing the
    geometry's state byte ranges). What a remap cannot plan (chunks whose bytes per token
    differ, e.g. NHD pages head-sliced by TP; unmodelled CPU kernels; Mamba groups without
    state bytes, or without a state geometry across TP sizes) is a HandshakeError naming
    ``who``."""
    tp = None if mapping is None else (mapping, src_rank)
    sstate = state if isinstance(src_state, str) else src_state
    try:
        if log:
            return regrain_plan(src_layout, dst_layout, src_plan, dst_plan, src_pages,
                                dst_pages, tp=tp, state=state, src_state=sstate)
        if state is None:
            check_push_mamba(src_layout, dst_layout)
        return RegrainPlan(src_layout, dst_layout, src_plan, dst_plan, src_pages, dst_pages,
                           tp=tp, src_state_bytes=sstate, dst_state_bytes=state)
    except LayoutError as e:
        raise HandshakeError(f"block-size remap with {who}: {e}") from e


def _positional(ids: Any, num_groups: int) -> tuple[np.ndarray, ...]:
    """D's registered positional table (null block 0 allowed: positions P must not write)
    as int32 arrays, converted once per push; BlockTableError naming the rule otherwise."""
    if len(ids) != num_groups:
        raise BlockTableError(f"the registration has {len(ids)} groups, the layout {num_groups}")
    try:
        return tuple(np.array(g, dtype=np.int32) for g in from_wire(ids, num_groups))
    except (TypeError, ValueError, OverflowError) as e:
        raise BlockTableError(f"registration rejected: {e}") from e


class _Inbox:
    """The receiver's transport: notifications the worker routed to it."""

    def __init__(self) -> None:
        self.msgs: list[bytes] = []

    def notifs(self) -> list[bytes]:
        out, self.msgs = self.msgs, []
        return out


def push_tag(push_id: str, rank: int, tp_size: int) -> str:
    """The prefix of the notifications prefill rank ``rank`` of a TP-``tp_size`` engine sends
    for ``push_id``: the push id itself at TP = 1, ``<push_id>@<rank>`` else (a decode rank
    fed by several prefill ranks tells their layers apart)."""
    return push_id if tp_size == 1 else f"{push_id}@{rank}"


@dataclasses.dataclass
class _Source:
    """D: a prefill engine (one handshake per rank): its TP size, every rank's agent name,
    and the ranks that WRITE into this rank."""

    tp: int
    names: tuple[str, ...]
    from_ranks: tuple[int, ...]
    checked: float = 0.0           # last liveness ping (time.monotonic())


@dataclasses.dataclass
class _Reg:
    """P: one push id's registrations on this rank: D's TP size and table (identical on
    every D rank), ``agents`` D rank -> agent name, ``reported`` to the scheduler."""

    dtp: int
    ids: list[list[int]]
    agents: dict[int, str] = dataclasses.field(default_factory=dict)
    reported: bool = False
    #: a decode engine of other block sizes: (D's first token, D's token count, D's sizes)
    remap: tuple[int, int, list[int]] | None = None
    table: tuple[np.ndarray, ...] | None = None    # ``ids`` as int32 arrays (first step)


@dataclasses.dataclass
class _Push:
    request_id: str
    peers: dict[int, str]          # consumer D rank -> agent name
    subs: list[str] = dataclasses.field(default_factory=list)   # pusher request ids
    steps: int = 0
    final_started: bool = False
    failed: str | None = None
    forward_end: float = 0.0
    last_write_done: float = 0.0
    first_post: float = 0.0
    cancelled_by: set[str] = dataclasses.field(default_factory=set)  # D agents to acknowledge
    abandoned: bool = False        # a step's WRITEs were released in flight (P's lease ended)


@dataclasses.dataclass
class _Cancel:
    """D: a push D gave up on while some prefill rank may still WRITE into its blocks; the
    blocks stay held (scheduler pin) until every rank in ``waiting`` acknowledged, the source
    is lost, or ``deadline`` (``time.monotonic()``) passes."""

    request_id: str
    key: tuple[str, int]
    waiting: set[str]
    deadline: float

