"""Layer-wise push bookkeeping: per-layer desc ids vs the full plan, pusher/receiver state
machines over an in-process transport that really copies bytes (ctypes.memmove), bad inputs."""
import ctypes

import numpy as np
import pytest
from hypothesis import given, strategies as st

from hmacore.errors import BlockTableError, LayoutError, TrackerStateError, TransferError
from hmacore.layerwise import LayerPlan, LayerwisePusher, LayerwiseReceiver, PushState, layer_metadata
from hmacore.demo.paged_memory import allocate_paged_kv, fill_pattern, verify_pattern
from hmacore.plan import Region, TransferPlan
from hmacore.presets import get_preset

from oracle_tp import dsv4_like_layout, full_sliding_layout


class MemTransport:
    """Posts copy bytes at once (memmove by descriptor rows); ``fail_after`` posts then ERR."""

    def __init__(self, ldesc, rdesc, fail_after=None):
        self.ldesc, self.rdesc = ldesc, rdesc
        self.inbox, self.posts, self.fail_after = [], 0, fail_after

    def post(self, op, peer, lids, rids, notif):
        assert op == "WRITE" and len(lids) == len(rids)
        self.posts += 1
        if self.fail_after is not None and self.posts > self.fail_after:
            return "ERR"
        for a, b in zip(lids.tolist(), rids.tolist()):
            la, n, _ = (int(x) for x in self.ldesc[a])
            ra, m, _ = (int(x) for x in self.rdesc[b])
            assert n == m
            ctypes.memmove(ra, la, n)
        self.inbox.append(notif)
        return "DONE"

    def state(self, h):
        return h

    def release(self, h):
        pass

    def send_notif(self, peer, msg):
        if self.fail_after is None or self.posts <= self.fail_after:
            self.inbox.append(msg)

    def notifs(self):
        out, self.inbox = self.inbox, []
        return out


def _sides(layout, nb=8, page=64, state_parts=2):
    p = allocate_paged_kv(layout, nb, page_bytes=page, state_parts=state_parts)
    d = allocate_paged_kv(layout, nb, page_bytes=page, state_parts=state_parts)
    pp = TransferPlan.from_kv_caches(layout, p.kv_caches, num_blocks=nb)
    dp = TransferPlan.from_kv_caches(layout, d.kv_caches, num_blocks=nb)
    return p, d, pp, dp


LAYOUTS = {"full_sliding": full_sliding_layout(), "dsv4": dsv4_like_layout(),
           "qwen3-next": get_preset("qwen3-next-80b", num_blocks=8)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layer_metadata_lists_every_layer_once(name):
    layout = LAYOUTS[name]
    plan = TransferPlan.from_layout(layout, 8, page_bytes=64 * 34)
    meta = layer_metadata(plan)
    assert set(meta) == set(layout.layer_to_group)
    for m in meta.values():
        assert m.group == layout.layer_to_group[m.name]
        for r, base in zip(m.regions, m.base):
            assert m.name in plan.regions[r].layers and plan.regions[r].base == base


@given(st.sampled_from(list(LAYOUTS)), st.data())
def test_layer_desc_ids_partition_the_full_plan_ids(name, data):
    layout = LAYOUTS[name]
    plan = TransferPlan.from_layout(layout, 8, page_bytes=64 * 34, kernel_block_size=None)
    lp = LayerPlan(plan)
    perm = data.draw(st.permutations(range(1, 8)))
    lens = [data.draw(st.integers(0, 2)) for _ in layout.groups]
    if sum(lens) > 7:
        lens = [min(n, 1) for n in lens]
    table, at = [], 0
    for n in lens:
        table.append(list(perm[at:at + n]))
        at += n
    full = plan.desc_ids(table)
    parts = [lp.desc_ids(layer, table) for layer in lp.layers]
    for p in parts:
        assert p.dtype == np.int64
    joined = np.concatenate(parts) if parts else np.empty(0, np.int64)
    # every descriptor of the request moved by exactly one layer, except aliased slots where the
    # full plan also moves a group's blocks through another group's layer slot (same bytes)
    assert len(set(joined.tolist())) == len(joined)
    assert set(joined.tolist()) <= set(full.tolist())
    desc = plan.descriptors()
    moved = sum(int(desc[i, 1]) for i in joined)
    l2g = layout.layer_to_group
    want = sum(len(table[l2g[n]]) * sum(b for b in lp.meta[n].block_len) for n in lp.layers)
    assert moved == want


def _push(layout, fail_after=None, page=64):
    p, d, pp, dp = _sides(layout, page=page)
    ptable = [[1 + 2 * g] for g in range(layout.num_groups)]
    dtable = [[2 + 2 * g] if 2 + 2 * g < 8 else [7] for g in range(layout.num_groups)]
    if layout.num_groups > 3:
        ptable = [[1], [2], [3], [4], [5]][:layout.num_groups]
        dtable = [[5], [4], [3], [2], [1]][:layout.num_groups]
    fill_pattern(p, ptable)
    tr = MemTransport(pp.descriptors(), dp.descriptors(), fail_after)
    released = []
    pusher = LayerwisePusher(tr, LayerPlan(pp), {"D": LayerPlan(dp)},
                             release=lambda rid, ids: released.append((rid, ids)))
    recv = LayerwiseReceiver(tr, len(pusher.local.layers))
    recv.expect("r1", dtable, timeout_s=0.2)
    pusher.start("r1", "D", ptable, dtable, lease_s=60)
    return p, d, pp, dp, tr, pusher, recv, ptable, dtable, released


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_push_every_layer_then_ready_and_bytes_match(name):
    layout = LAYOUTS[name]
    page = 64 * 34 if name == "qwen3-next" else 64
    p, d, pp, dp, tr, pusher, recv, ptable, dtable, released = _push(layout, page=page)
    layers = pusher.local.layers
    for k, layer in enumerate(layers):
        pusher.save_layer("r1", layer)
        pusher.progress()
        recv.poll()
        if k < len(layers) - 1:
            assert recv.state("r1") == PushState.WAITING and recv.valid_blocks("r1") is None
    assert pusher.state("r1") == PushState.SENT
    recv.poll()
    assert recv.state("r1") == PushState.READY
    assert [list(x) for x in recv.valid_blocks("r1")] == dtable
    assert verify_pattern(d, dtable) == []
    pusher.finish("r1")
    assert released and released[0][0] == "r1" and pusher.requests == ()


def test_partial_failure_leaves_decode_failed_with_nothing_valid():
    layout = LAYOUTS["full_sliding"]
    p, d, pp, dp, tr, pusher, recv, ptable, dtable, released = _push(layout, fail_after=2)
    for layer in pusher.local.layers:
        pusher.save_layer("r1", layer)
        pusher.progress()
    assert pusher.state("r1") == PushState.FAILED and "WRITE failed" in pusher.error("r1")
    recv.poll()
    assert recv.state("r1") in (PushState.WAITING, PushState.FAILED)
    import time
    time.sleep(0.25)
    recv.poll()
    assert recv.state("r1") == PushState.FAILED and recv.valid_blocks("r1") is None
    assert recv.layers_arrived("r1") == 2


def test_lease_end_releases_blocks():
    layout = LAYOUTS["full_sliding"]
    p, d, pp, dp, tr, pusher, recv, ptable, dtable, released = _push(layout)
    pusher._reqs["r1"].expires_at = 0.0
    pusher.progress()
    assert released[0][0] == "r1" and [list(x) for x in released[0][1]] == ptable
    with pytest.raises(TrackerStateError, match="not being pushed"):
        pusher.state("r1")


def test_bad_inputs():
    layout = LAYOUTS["full_sliding"]
    p, d, pp, dp, tr, pusher, recv, ptable, dtable, released = _push(layout)
    with pytest.raises(TrackerStateError, match="already being pushed"):
        pusher.start("r1", "D", ptable, dtable)
    with pytest.raises(TransferError, match="unknown peer 'X'"):
        pusher.start("r2", "X", ptable, dtable)
    with pytest.raises(BlockTableError, match="group 1: 1 local vs 2 remote"):
        pusher.start("r2", "D", ptable, [[2], [4, 5]])
    with pytest.raises(BlockTableError, match="out of range"):
        pusher.start("r2", "D", ptable, [[2], [99]])
    assert pusher.requests == ("r1",)  # nothing half-applied
    with pytest.raises(LayoutError, match="layer 'nope' is not in the plan"):
        pusher.save_layer("r1", "nope")
    pusher.save_layer("r1", "full.0")
    with pytest.raises(TrackerStateError, match="saved twice"):
        pusher.save_layer("r1", "full.0")
    with pytest.raises(LayoutError, match="num_layers must be an int >= 1"):
        LayerwiseReceiver(tr, 0)
    with pytest.raises(TrackerStateError, match="must not contain ':'"):
        recv.expect("a:b", dtable)
    with pytest.raises(BlockTableError, match="block_ids must be 2 per-group id lists"):
        LayerPlan(pp).desc_ids("full.0", [[1]])


def test_layer_in_two_groups_is_rejected():
    layout = LAYOUTS["full_sliding"]
    bad = Region(0, 64, 64, 8, 1, 1, False, ("full.0",))
    with pytest.raises(LayoutError, match="layer 'full.0' of group 0 sits in region 0 owned by group 1"):
        layer_metadata(TransferPlan(layout, [bad]))


def test_notification_tag_and_per_peer_local_layers():
    """Several pusher requests (one per decode rank) share a notification tag; a peer's own
    local LayerPlan (a TP pair's descriptors) must list the same layers as its remote one."""
    layout = LAYOUTS["full_sliding"]
    p, d, pp, dp, tr, pusher, recv, ptable, dtable, released = _push(layout)
    recv.expect("push@1", dtable, timeout_s=60)
    pusher.start("push@1>0", "D", ptable, dtable, lease_s=60, tag="push@1")
    for layer in pusher.local.layers:
        pusher.save_layer("push@1>0", layer)
        pusher.progress()
    recv.poll()
    assert pusher.state("push@1>0") == PushState.SENT
    assert recv.state("push@1") == PushState.READY
    with pytest.raises(TrackerStateError, match="tag must not contain ':'"):
        pusher.start("x", "D", ptable, dtable, tag="a:b")
    sub = LayerPlan(TransferPlan(layout, dp.regions[:1]))
    assert set(sub.layers) < set(LayerPlan(dp).layers)
    with pytest.raises(LayoutError, match="pair layers differ"):
        pusher.add_peer("E", LayerPlan(dp), local_layers=sub)


class HeldTransport(MemTransport):
    """Every posted WRITE stays in flight (PROC) until ``end`` is called with its handle's
    state; release is recorded (releasing a PROC handle is what must never happen)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.states, self.released, self.released_in_flight = {}, [], []

    def post(self, op, peer, lids, rids, notif):
        super().post(op, peer, lids, rids, notif)
        h = len(self.states)
        self.states[h] = "PROC"
        return h

    def state(self, h):
        return self.states[h]

    def release(self, h):
        (self.released_in_flight if self.states[h] == "PROC" else self.released).append(h)


@pytest.mark.parametrize("how", ["stop", "error"])
def test_stopped_or_failed_push_keeps_in_flight_writes_until_they_end(how):
    # a cancelled (stop) or failed push posts nothing more, but its WRITEs already posted
    # stay tracked (in_flight) until NIXL says DONE / ERR, and only then are released
    layout = LAYOUTS["full_sliding"]
    p, d, pp, dp, _, _, _, ptable, dtable, _ = _push(layout)
    tr = HeldTransport(pp.descriptors(), dp.descriptors())
    pusher = LayerwisePusher(tr, LayerPlan(pp), {"D": LayerPlan(dp)})
    pusher.start("r1", "D", ptable, dtable, lease_s=60)
    layers = pusher.local.layers
    pusher.save_layer("r1", layers[0])
    pusher.save_layer("r1", layers[1])
    assert pusher.in_flight("r1") == 2
    if how == "stop":
        pusher.stop("r1")
    else:
        tr.states[0] = "ERR"
    pusher.progress()
    assert pusher.state("r1") == PushState.FAILED
    assert pusher.in_flight("r1") == (2 if how == "stop" else 1)
    posts = tr.posts
    pusher.save_layer("r1", layers[2])          # nothing more is posted
    assert tr.posts == posts
    tr.states[1] = "DONE"
    if how == "stop":
        tr.states[0] = "DONE"
    pusher.progress()
    assert pusher.in_flight("r1") == 0 and sorted(tr.released) == [0, 1]
    assert tr.released_in_flight == []
    pusher.finish("r1")
    assert pusher.requests == ()
