"""How a transfer's descriptors reach NIXL: per block, or one descriptor per maximal run.

NIXL's prepared dlists are indexed per descriptor, so a run that covers many blocks (or a
block's adjacent layer slots) has no index of its own. Two ways post a run, and ``"auto"``
picks the cheaper per request:

* ``"dynamic"``: the runs themselves, as two descriptor lists built for this request
  (``get_xfer_descs`` + ``initialize_xfer``): NIXL gets exactly the runs. Costs a few tens of
  ns per run plus ~10 us per request (measured, docs/performance.md "Fewest descriptors").
* ``"prepped"``: the per-block ids into the prepared dlists, reordered into run order; NIXL
  merges neighbours whose ids are consecutive and whose bytes abut on both sides
  (``make_prepped_xfer``'s merge, measured), so runs inside one region (consecutive blocks,
  up or down) reach UCX as one descriptor, for the cost of posting every block id; a run
  across regions (a block's adjacent layer slots, K next to V) is not merged that way.
* ``"auto"`` (default): prepped in run order only when that loses nothing (every run joins
  consecutive ids: ``Runs.index_breaks == 0``) and the runs are more than
  :data:`AUTO_DYNAMIC_FRACTION` of the per-block descriptors (scattered tables: new lists
  would cost more than the prepped ids, and the run search is the only extra work); else
  dynamic.
* ``"blocks"``: per-block ids in plan order, vLLM 0.32's scheme (NIXL then merges only
  ascending neighbours); the benchmarks' baseline.

Units: descriptor ids index the prepared dlists; rows are ``(addr, bytes, dev)`` uint64.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..runs import DescTable, find_runs

__all__ = ["POSTINGS", "AUTO_DYNAMIC_FRACTION", "Posted", "check_posting", "create_xfer",
           "post_xfer"]

POSTINGS = ("auto", "dynamic", "prepped", "blocks")
#: "auto" posts the runs as new lists when they are at most this fraction of the per-block
#: descriptors (a dynamic descriptor costs about twice a prepped index, both measured)
AUTO_DYNAMIC_FRACTION = 0.5


def check_posting(posting: str) -> str:
    if posting not in POSTINGS:
        raise ValueError(f"posting must be one of {list(POSTINGS)}, got {posting!r}")
    return posting


@dataclasses.dataclass
class Posted:
    """A posted transfer: NIXL's handle and state, the descriptors NIXL was given
    (``descriptors``), the per-block descriptors they replace and the maximal runs."""

    handle: Any
    state: str
    descriptors: int
    block_descriptors: int
    runs: int
    mechanism: str


def post_xfer(agent: Any, op: str, posting: str, peer: str, *, local_dlist: Any,
              local_ids: np.ndarray, remote_dlist: Any, remote_ids: np.ndarray,
              local_table: DescTable | None, remote_table: DescTable | None,
              local_mem: str, remote_mem: str, notif_msg: bytes) -> Posted:
    """Create (:func:`create_xfer`) and post one transfer on a ``nixl_agent``. Raises
    BlockTableError from the run search (nothing posted) and NIXL's own errors from the post
    (the handle, if any, is released)."""
    posted = create_xfer(agent, op, posting, peer, local_dlist=local_dlist,
                         local_ids=local_ids, remote_dlist=remote_dlist, remote_ids=remote_ids,
                         local_table=local_table, remote_table=remote_table,
                         local_mem=local_mem, remote_mem=remote_mem, notif_msg=notif_msg)
    posted.state = _start(agent, posted.handle)
    return posted


def create_xfer(agent: Any, op: str, posting: str, peer: str, *, local_dlist: Any,
                local_ids: np.ndarray, remote_dlist: Any, remote_ids: np.ndarray,
                local_table: DescTable | None, remote_table: DescTable | None,
                local_mem: str, remote_mem: str, notif_msg: bytes,
                skip_desc_merge: bool = False) -> Posted:
    """The NIXL transfer handle of one transfer, not yet posted (``state`` "INIT"): the
    per-request bookkeeping the benchmarks time. Ids non-empty and validated by the caller
    against the dlists. ``skip_desc_merge``: with ``"blocks"``, ask NIXL not to merge
    neighbouring descriptors (benchmarks: the cost of one descriptor per block)."""
    n = int(local_ids.size)
    if posting == "blocks" or local_table is None or remote_table is None or n == 0:
        kw = {"skip_desc_merge": True} if skip_desc_merge else {}
        h = agent.make_prepped_xfer(op, local_dlist, local_ids, remote_dlist, remote_ids,
                                    notif_msg=notif_msg, **kw)
        return Posted(h, "INIT", n, n, -1, "blocks")
    runs = find_runs(local_table, local_ids, remote_table, remote_ids,
                     order=posting != "dynamic")
    m = runs.num_runs
    if posting == "dynamic" or (posting == "auto" and (runs.index_breaks
                                                       or m <= AUTO_DYNAMIC_FRACTION * n)):
        h = agent.initialize_xfer(op, agent.get_xfer_descs(runs.local, local_mem),
                                  agent.get_xfer_descs(runs.remote, remote_mem), peer,
                                  notif_msg)
        return Posted(h, "INIT", m, n, m, "dynamic")
    order = runs.order
    h = agent.make_prepped_xfer(op, local_dlist, local_ids[order], remote_dlist,
                                remote_ids[order], notif_msg=notif_msg)
    return Posted(h, "INIT", n, n, m, "prepped")


def _start(agent: Any, h: Any) -> str:
    try:
        return agent.transfer(h)
    except BaseException:
        try:
            agent.release_xfer_handle(h)
        except Exception:  # noqa: BLE001 - the post's error is the one to report
            pass
        raise
