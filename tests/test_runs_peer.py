"""hmacore.transport.runs_peer (no transport library needed): the handshake rules of a
block-size remap peer, shared by NixlAgent.add_regrain_peer and
MooncakeTeAgent.add_regrain_peer, and the bounds check of byte-run rows."""
import dataclasses

import numpy as np
import pytest

from hmacore.errors import HandshakeError
from hmacore.transport.handshake import PROTOCOL_VERSION, HandshakePayload
from hmacore.transport.runs_peer import checked_runs, regrain_peer_plan

from regrain_scenarios import World


def _sides(scenario="gemma_p16_d32"):
    w = World(scenario, 40, 0, 1)
    mine = HandshakePayload.for_plan(w.dplan, "d", b"")
    theirs = HandshakePayload.for_plan(w.splan, "p", b"")
    return w, mine, theirs


def test_default_layout_scales_block_sizes_and_pages_and_keeps_regions():
    w, mine, theirs = _sides()
    plan = regrain_peer_plan(mine, theirs, w.dlay)           # layout derived from D's
    assert plan.layout.block_sizes == w.slay.block_sizes != w.dlay.block_sizes
    assert plan.layout.fingerprint() == w.slay.fingerprint()
    assert [r.base for r in plan.regions] == [r.base for r in w.splan.regions]
    assert [r.block_len for r in plan.regions] == [r.block_len for r in w.splan.regions]


@pytest.mark.parametrize("change,match", [
    (dict(version=1), f"peer 'p' disagrees on version: local {PROTOCOL_VERSION}, remote 1"),
    (dict(hma=False), "peer 'p' disagrees on HMA on/off"),
    (dict(block_sizes=(16,)), "peer 'p' disagrees on group count"),
    (dict(block_sizes=(24, 24)), r"peer 'p': group 0: .*integer multiple"),
    (dict(layout_fingerprint="0" * 16), "disagrees on the layout beyond block sizes"),
    (dict(regions=()), "peer 'p': bad region table"),
])
def test_remap_peer_refusals_name_the_peer_and_the_rule(change, match):
    w, mine, theirs = _sides()
    bad = dataclasses.replace(theirs, **change)
    with pytest.raises(HandshakeError, match=match):
        regrain_peer_plan(mine, bad, w.dlay, w.slay if "regions" in change else None)


def test_mamba_groups_must_keep_their_block_size():
    w, mine, theirs = _sides("qwen_next_p16_d64")
    plan = regrain_peer_plan(mine, theirs, w.dlay)           # Mamba equal: accepted
    assert plan.layout.block_sizes == w.slay.block_sizes
    sizes = list(theirs.block_sizes)
    g = next(i for i, s in enumerate(w.dlay.groups) if s.kind.name == "MAMBA")
    sizes[g] *= 2
    with pytest.raises(HandshakeError, match=f"group {g}: state group {g} has"):
        regrain_peer_plan(mine, dataclasses.replace(theirs, block_sizes=tuple(sizes)), w.dlay)


def test_checked_runs_pairs_rows_and_bounds_each_side():
    mine, peer = [(1 << 20, 4096, 0)], [(1 << 30, 4096, 0)]
    loc = np.array([[(1 << 20) + 16, 32, 0], [(1 << 20) + 4064, 32, 0]], np.uint64)
    rem = np.array([[(1 << 30), 32, 0], [(1 << 30) + 64, 32, 0]], np.uint64)
    a, b = checked_runs(loc, rem, mine, peer)
    assert a.dtype == np.uint64 and np.array_equal(a, loc) and np.array_equal(b, rem)
    far = rem.copy()
    far[1, 0] += 4096                                        # past the peer's range
    with pytest.raises(ValueError, match="remote runs outside registered memory"):
        checked_runs(loc, far, mine, peer)
    late = loc.copy()
    late[1, 0] += 1                                          # one byte past the range end
    with pytest.raises(ValueError, match="local runs outside registered memory"):
        checked_runs(late, rem, mine, peer)
    short = rem.copy()
    short[0, 1] = 16
    with pytest.raises(ValueError, match="must pair up with equal lengths"):
        checked_runs(loc, short, mine, peer)
    with pytest.raises(ValueError, match="must pair up"):
        checked_runs(loc, rem[:1], mine, peer)
    empty = np.zeros((0, 3), np.uint64)
    assert checked_runs(empty, empty, mine, peer)[0].shape == (0, 3)
    with pytest.raises(ValueError, match="at least one row"):
        checked_runs(empty, empty, mine, peer, allow_empty=False)
