"""The demo's decode side: allocate, select, clip, trim, pull over NIXL, verify every byte."""
from __future__ import annotations

import time

import numpy as np

from ..spec import GroupKind
from .clock import Clock
from .paged_memory import allocate_paged_kv, verify_pattern
from ..plan import TransferPlan
from ..tables import TrackerSet, fill_blocks, from_wire
from ..transport.handshake import exchange_handshake
from ..transport.nixl import NixlAgent
from ..windows import clip_to_window, trim_remote_to_local
from .scenario import BlockPool, Scenario

TRANSFER_TIMEOUT_S = 60.0


class DecodeSide:
    """Decode instance of the demo. Figures accumulate per group over all requests.

    Attributes (per group lists): ``blocks``, ``descriptors``, ``bytes`` moved; ``plan_hma`` /
    ``non_hma`` descriptor and byte totals from the transfer plan's figures for the same
    requests; ``bookkeeping_ns`` per request; ``mismatches`` as (request, layer, group, block
    index) of every page whose bytes differ.
    """

    def __init__(self, sc: Scenario, remote_num_blocks: int, posting: str = "auto"):
        layout = sc.layout()
        self.scenario = sc
        self.num_blocks = sc.num_blocks()
        self.layout = layout.with_num_blocks(self.num_blocks)
        self.paged = allocate_paged_kv(self.layout, self.num_blocks, page_bytes=sc.page_size())
        for s in self.paged.storages:   # written once, as vLLM's torch.zeros KV cache is:
            s.fill(0)                    # no first-touch page faults inside the transfers
        self.plan = TransferPlan.from_kv_caches(self.layout, self.paged.kv_caches,
                                                num_blocks=self.num_blocks)
        self.posting = posting
        # This side only initiates READs (nobody reads or writes its memory, it receives no
        # notifications), so it runs no NIXL progress thread: its own calls progress UCX.
        # Measured (docs/performance.md, "Where the time goes"): during a READ that thread
        # used as much CPU again as the READ's own copy, on the cores the copy needs.
        self.agent = NixlAgent("hmacore-demo-decode", self.plan, posting=posting,
                               progress_thread=False)
        self.pool = BlockPool(self.num_blocks)
        self.trackers = TrackerSet(self.layout)
        G = self.layout.num_groups
        self.blocks = [0] * G
        self.descriptors = [0] * G
        self.bytes = [0] * G
        self.plan_hma_descriptors = 0
        self.plan_hma_bytes = 0
        self.non_hma_descriptors = 0
        self.non_hma_bytes = 0
        self.bookkeeping_ns: list[int] = []
        self.transfer_s = 0.0
        self.transfer_clock = Clock()   # the READs' wall time: on CPU vs waiting for one
        self.memcpy_clock = Clock()
        self.posted_descriptors = 0     # what NIXL was given
        self.block_descriptors = 0      # one per block per layer slot (the plan's)
        self.runs = 0                   # maximal runs (-1 per transfer when not searched)
        self.memcpy_s = 0.0             # memcpy of the same bytes, same run (reference)
        self._copy: tuple[np.ndarray, np.ndarray] | None = None
        self.mismatches: list[tuple[str, str, int, int]] = []
        self.pages_checked = 0
        self.bytes_checked = 0
        self.errors: list[str] = []
        self.done = 0
        self.peer = None

    @property
    def bytes_moved(self) -> int:
        return sum(self.bytes)

    def connect(self, host: str, port: int) -> None:
        remote = exchange_handshake(host, port, self.agent.handshake_payload())
        self.peer = self.agent.add_peer(remote)

    def pull(self, msg: dict) -> None:
        """Handle one finished request from the prefill side (its kv_transfer_params)."""
        params = msg["kv_transfer_params"]
        rid, n = params["remote_request_id"], int(params["remote_num_tokens"])
        layout, G = self.layout, self.layout.num_groups
        table = self.pool.allocate_table(layout, n)          # vLLM's allocation for n external tokens
        t0 = time.perf_counter_ns()
        self.trackers.add(rid, table, num_prompt_tokens=n)
        hashed = [np.zeros(len(g), dtype=np.uint8) for g in table]   # nothing cached locally
        local = clip_to_window(fill_blocks(table, hashed), layout)
        remote = from_wire(params["remote_block_ids"], G)
        local, remote = trim_remote_to_local(local, remote, layout)
        local_desc = self.plan.desc_ids(local)
        self.bookkeeping_ns.append(time.perf_counter_ns() - t0)

        before = list(self.bytes)
        for g in range(G):   # per-group figures: each group's blocks alone through the plan
            only = tuple(local[h] if h == g else np.empty(0, np.int32) for h in range(G))
            ids = self.plan.desc_ids(only)
            self.blocks[g] += int(local[g].size)
            self.descriptors[g] += int(ids.size)
            self.bytes[g] += self.plan.desc_bytes(ids)
        assert sum(self.descriptors) >= local_desc.size
        fig = self.plan.request_figures(n)
        self.plan_hma_descriptors += fig.hma_descriptors
        self.plan_hma_bytes += fig.hma_bytes
        self.non_hma_descriptors += fig.non_hma_descriptors
        self.non_hma_bytes += fig.non_hma_bytes

        try:
            with self.transfer_clock:
                xfer = self.agent.read(rid, self.peer, local, remote, notif=b"done")
                self.agent.wait(xfer, timeout=TRANSFER_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - reported as a failed request
            self.errors.append(f"{rid}: {e}")
            self.mismatches.append((rid, "*", -1, -1))
        else:
            self.posted_descriptors += xfer.descriptors
            self.block_descriptors += xfer.block_descriptors
            self.runs += xfer.runs
        self.transfer_s = self.transfer_clock.wall
        self._memcpy(sum(self.bytes) - sum(before))
        self.memcpy_s = self.memcpy_clock.wall

        # Verify: local[g][k] must hold block position (len(table[g]) - len(local[g]) + k).
        positions = [range(len(table[g]) - len(local[g]), len(table[g])) for g in range(G)]
        for layer, g, j in verify_pattern(self.paged, local, positions):
            self.mismatches.append((rid, layer, g, j))
        for g in layout.transfer_group_ids:
            pages = int(local[g].size) * len(layout.groups[g].layer_names)
            self.pages_checked += pages
            self.bytes_checked += pages * self.paged.page_bytes[g]
        self.trackers.set_loaded_tokens(rid, n)
        self.pool.free(self.trackers.finish(rid))
        self.done += 1

    def _memcpy(self, nbytes: int) -> None:
        """One memcpy of ``nbytes`` between two warm buffers of this process, timed on
        :attr:`memcpy_clock`: the physical reference for the transfer of the same bytes.
        Both sides are equal on page faults: these buffers are written before they are
        timed, as the KV memory is (written once at start, both processes)."""
        if nbytes <= 0:
            return
        if self._copy is None or self._copy[0].size < nbytes:
            self._copy = (np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8))
            np.copyto(self._copy[1], self._copy[0])          # warm both
        src, dst = self._copy[0][:nbytes], self._copy[1][:nbytes]
        with self.memcpy_clock:
            np.copyto(dst, src)

    def close(self) -> None:
        self.agent.close()


def expected_blocks(layout, num_tokens: int) -> tuple[int, ...]:
    """Blocks per group the demo should move for one request (used by the tests)."""
    from .scenario import real_positions
    out = []
    for spec in layout.groups:
        live = len(real_positions(spec, num_tokens))
        w = spec.window_blocks()
        out.append(min(live, w) if w else (min(live, 1) if spec.kind == GroupKind.MAMBA else live))
    return tuple(out)


__all__ = ["DecodeSide", "expected_blocks"]
