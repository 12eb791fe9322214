"""TP-aware handshake: peers of different TP sizes (and block sizes) are accepted over the real
loopback socket exchange and the TpPairPlans built from what it delivered equal the ones built
from the plans directly; genuinely mismatched layouts are rejected naming the field."""
import dataclasses
import json

import numpy as np
import pytest

from hmacore.errors import HandshakeError
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tp import GroupSharding, TpMapping, build_pair_plans
from hmacore.transport.handshake import (HandshakePayload, HandshakeServer, TpDescription,
                                         exchange_handshake, tp_fingerprint_fields)
from hmacore.transport.tp_peer import tp_pair_plans

from oracle_tp import dsv4_like_layout, full_sliding_layout, rank_pages

FS_SH = [(4, 2, False)] * 2


def _tp(tp, rank, *, lay=None, sh=FS_SH, hbb=64, nb=8, name=None, dtype="bfloat16", head_dim=16,
        page_layout="HND", hbb_list=None):
    lay = lay or full_sliding_layout()
    plan = TransferPlan.from_layout(lay, nb, page_bytes=rank_pages(sh, hbb_list or [hbb] * len(sh), tp))
    p = HandshakePayload.for_tp_plan(plan, name or f"r{tp}.{rank}", b"\x00m", tp_size=tp,
                                     tp_rank=rank, shardings=[GroupSharding(*s) for s in sh],
                                     kv_dtype=dtype, head_dim=head_dim, page_layout=page_layout)
    return p, plan


def _descs(pairs):
    return {r: (p.local.descriptors().tolist(), p.remote.descriptors().tolist())
            for r, p in pairs.items()}


def test_tp_payload_round_trip_and_hash_ignores_tp_shapes():
    p, _ = _tp(2, 1)
    q = HandshakePayload.from_bytes(p.to_bytes())
    assert q == p and q.tp.tp_size == 2 and q.tp.tp_rank == 1
    d, _ = _tp(1, 0, nb=16)
    assert d.regions[0]["block_len"] != p.regions[0]["block_len"]
    assert d.compatibility_hash == p.compatibility_hash  # TP-invariant fingerprint
    d.check_compatible(p)
    p.check_compatible(d)


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2), (2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("case", ["full_sliding", "dsv4"])
def test_hetero_tp_over_socket_builds_the_same_pair_plans(case, tp_p, tp_d):
    if case == "dsv4":
        kw = dict(lay=dsv4_like_layout(), sh=[(1, 1, True)] * 3 + [(4, 1, False)] * 2,
                  hbb_list=[256, 64, 64, 32, 64])
    else:
        kw = {}
    prefill = [_tp(tp_p, r, name=f"P{r}", **kw) for r in range(tp_p)]
    seen = []
    servers = [HandshakeServer(p, on_peer=seen.append) for p, _ in prefill]
    try:
        for d in range(tp_d):
            me, plan = _tp(tp_d, d, name=f"D{d}", **kw)
            got = [exchange_handshake("127.0.0.1", s.port, me) for s in servers]
            assert [g.agent_name for g in got] == [f"P{r}" for r in range(tp_p)]
            mapping, pairs, ratio = tp_pair_plans(me, plan, got)
            assert ratio == 1 and mapping.remote_tp == tp_p
            want = build_pair_plans(
                TpMapping(plan.layout, [GroupSharding(*s) for s in kw.get("sh", FS_SH)],
                          local_tp=tp_d, local_rank=d, remote_tp=tp_p),
                plan, {r: prefill[r][1] for r in range(tp_p)})
            assert _descs(pairs) == _descs(want)
    finally:
        for s in servers:
            s.close()
    # the prefill side learned each decode rank's TP rank from the handshake
    assert sorted((p.agent_name, p.tp.tp_rank) for p in seen) == \
        sorted((f"D{d}", d) for d in range(tp_d) for _ in range(tp_p))
    assert all(not s.errors for s in servers)


def test_block_size_ratio_over_socket():
    p_lay, d_lay = full_sliding_layout(8, window=32), full_sliding_layout(16)
    prefill = [_tp(2, r, lay=p_lay, hbb=32, name=f"P{r}") for r in range(2)]
    me, plan = _tp(1, 0, lay=d_lay, hbb=64, name="D0")
    with HandshakeServer(prefill[0][0]) as s0, HandshakeServer(prefill[1][0]) as s1:
        got = [exchange_handshake("127.0.0.1", s.port, me) for s in (s0, s1)]
    mapping, pairs, ratio = tp_pair_plans(me, plan, got)
    assert ratio == 2
    want = build_pair_plans(mapping, plan, {r: prefill[r][1] for r in range(2)}, block_size_ratio=2)
    assert _descs(pairs) == _descs(want)
    # the opposite direction (local blocks smaller than the peer's) handshakes, but cannot pair
    p16, _ = _tp(1, 0, lay=d_lay, hbb=64, name="P16")
    me8, plan8 = _tp(2, 0, lay=p_lay, hbb=32, name="D8")
    me8.check_compatible(p16)
    with pytest.raises(HandshakeError, match="local block size 8 is not a multiple of the peer's 16"):
        tp_pair_plans(me8, plan8, [p16])


def _layout_with(**changes):
    lay = full_sliding_layout()
    g1 = dataclasses.replace(lay.groups[1], **changes)
    return KVLayout(groups=(lay.groups[0], g1))


@pytest.mark.parametrize("kw,match", [
    (dict(dtype="fp8_e4m3"), "kv_dtype: local 'bfloat16', remote 'fp8_e4m3'"),
    (dict(head_dim=32), "head_dim: local 16, remote 32"),
    (dict(page_layout="LBHNC"), "page_layout: local 'HND', remote 'LBHNC'"),
    (dict(sh=[(4, 2, False), (8, 2, False)]), "group 1 total KV heads: local 4, remote 8"),
    (dict(sh=[(4, 2, False), (4, 1, False)]), "group 1 chunks per block: local 2, remote 1"),
    (dict(lay=_layout_with(sliding_window=64)), "group 1 sliding_window: local 32, remote 64"),
    (dict(lay=_layout_with(layer_names=("swa.0", "swa.9"))),
     r"group 1 layer names \(layer->group map\): first difference at index 1: 'swa.1' vs 'swa.9'"),
    (dict(lay=_layout_with(kind=GroupKind.FULL, sliding_window=None)),
     "group 1 kind: local 'SLIDING_WINDOW', remote 'FULL'"),
    (dict(lay=dsv4_like_layout(), sh=[(1, 1, True)] * 5), "group count: local 2, remote 5"),
    (dict(lay=full_sliding_layout(12, window=32), hbb=48),
     "block sizes: group 0 has 16 tokens locally, 12 remotely"),
    (dict(lay=KVLayout(groups=(GroupSpec(GroupKind.FULL, 8, ("full.0", "full.1")),
                               GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("swa.0", "swa.1"),
                                         sliding_window=32))), hbb_list=[32, 64]),
     r"block sizes: local \[16, 16\], remote \[8, 16\] \(one block-size ratio must hold for every "
     r"attention group\)"),
    (dict(hbb=128), r"region shapes of layer 'full.0' \(group 0\): 4 B per head per token locally "
                    r"\(TP 1\), 8 B per head per token remotely \(TP 2\)"),
])
def test_mismatched_layouts_are_rejected_naming_the_field(kw, match):
    me, _ = _tp(1, 0, name="D")
    other, _ = _tp(2, 1, name="P", **kw)
    with pytest.raises(HandshakeError, match=match):
        me.check_compatible(other)
    field = match.split(":")[0].split(r" \(")[0]  # the server names the same field
    with HandshakeServer(other) as srv:
        with pytest.raises(HandshakeError, match="rejected the handshake: peer 'D' disagrees on "
                                                 + field):
            exchange_handshake("127.0.0.1", srv.port, me)
        assert len(srv.errors) == 1


def test_tp_size_that_does_not_fit_the_heads_is_rejected():
    me, _ = _tp(1, 0)
    bad, _ = _tp(1, 0, name="P3")
    bad = dataclasses.replace(bad, tp=dataclasses.replace(bad.tp, tp_size=3, tp_rank=2))
    with pytest.raises(HandshakeError, match="remote TP size 3 does not fit group 0's heads: "
                                             "tp 3 does not divide num_heads 4"):
        me.check_compatible(bad)


def test_tp_aware_and_plain_peers_do_not_mix():
    me, plan = _tp(1, 0)
    plain = HandshakePayload.for_plan(plan, "plain", b"")
    with pytest.raises(HandshakeError, match="TP awareness: the remote side sent no TP description"):
        me.check_compatible(plain)
    with pytest.raises(HandshakeError, match="TP awareness: the local side sent no TP description"):
        plain.check_compatible(me)


def test_tp_description_and_payload_bad_input():
    _, plan = _tp(1, 0)
    for kw, match in ((dict(tp_size=2, tp_rank=2), r"tp_rank 2 is not in \[0, 2\)"),
                      (dict(tp_size=0, tp_rank=0), "tp_size must be an int >= 1"),
                      (dict(tp_size=1, tp_rank=0, head_dim=0), "head_dim must be an int >= 1"),
                      (dict(tp_size=1, tp_rank=0, kv_dtype=""), "kv_dtype must be a non-empty"),
                      (dict(tp_size=1, tp_rank=0, page_layout="hnd"), "page_layout must be one of"),
                      (dict(tp_size=1, tp_rank=0, shardings=[GroupSharding()]), "1 shardings for 2 groups")):
        args = {"shardings": [GroupSharding(4, 2)] * 2, "kv_dtype": "bf16", "head_dim": 16, **kw}
        with pytest.raises(HandshakeError, match=match):
            HandshakePayload.for_tp_plan(plan, "x", b"", **args)
    p, _ = _tp(1, 0)
    d = json.loads(p.to_bytes())
    d["tp"]["head_dim"] = 64
    with pytest.raises(HandshakeError, match="does not match its content"):
        HandshakePayload.from_bytes(json.dumps(d).encode())
    d["tp"] = {"tp_size": 1}
    with pytest.raises(HandshakeError, match="malformed handshake payload"):
        HandshakePayload.from_bytes(json.dumps(d).encode())


def test_pair_plans_need_every_source_rank_once():
    me, plan = _tp(1, 0, name="D")
    p0, _ = _tp(2, 0, name="P0")
    p1, _ = _tp(2, 1, name="P1")
    with pytest.raises(HandshakeError, match=r"reads from remote ranks \[0, 1\] but has no "
                                             r"handshake with \[1\]"):
        tp_pair_plans(me, plan, [p0])
    p0b, _ = _tp(2, 0, name="P0b")
    with pytest.raises(HandshakeError, match="both claim remote rank 0"):
        tp_pair_plans(me, plan, [p0, p0b, p1])
    q, _ = _tp(4, 1, name="Q")
    with pytest.raises(HandshakeError, match=r"peers disagree on their TP size: \[2, 4\]"):
        tp_pair_plans(me, plan, [p0, q])
    with pytest.raises(HandshakeError, match="peers is empty"):
        tp_pair_plans(me, plan, [])
    plain = HandshakePayload.for_plan(plan, "plain", b"")
    with pytest.raises(HandshakeError, match="local payload has no TP description"):
        tp_pair_plans(plain, plan, [p0, p1])


def test_fingerprint_fields_exclude_tp_dependent_values():
    a, _ = _tp(1, 0)
    b, _ = _tp(4, 3, lay=full_sliding_layout(8, window=32), hbb=32)
    assert tp_fingerprint_fields(a.tp) == tp_fingerprint_fields(b.tp)
    assert isinstance(a.tp, TpDescription)
    assert np.asarray(a.block_sizes).tolist() == [16, 16]


# -- Mamba state geometry (protocol 5) ---------------------------------------------------

def _ssm(tp, rank, geo, *, page=None, name=None):
    """A one-group Mamba layout; pages = the geometry's per-rank content + 64 B padding."""
    from hmacore.state_tp import GlobalStateGeometry
    lay = KVLayout([GroupSpec(GroupKind.MAMBA, 16, ("ssm.0", "ssm.1"), name="ssm")])
    content = geo.at(tp).content_bytes if isinstance(geo, GlobalStateGeometry) else 512
    page = page or content + 64
    from hmacore.plan import Region
    plan = TransferPlan(lay, [Region(0x1000 + i * page * 4, page, page, 4, 1, 0, True, (n,))
                              for i, n in enumerate(("ssm.0", "ssm.1"))])
    p = HandshakePayload.for_tp_plan(plan, name or f"s{tp}.{rank}", b"\x00m", tp_size=tp,
                                     tp_rank=rank, shardings=[GroupSharding(1, 1, True, state=geo)],
                                     kv_dtype="none", head_dim=1)
    return p, plan


def _gdn(layout="DS"):
    from hmacore.state_tp import GlobalStateGeometry
    return GlobalStateGeometry("GDN_ATTN", layout, 3, 2, (16, 16, 32), (2, 2, 4), 4, 128)


def test_state_geometry_travels_and_pairs_across_tp_sizes():
    p, _ = _ssm(1, 0, _gdn(), name="P0")
    q = HandshakePayload.from_bytes(p.to_bytes())
    assert q == p and q.tp.states[0] == _gdn().to_wire() and q.version == 5
    servers = [HandshakeServer(p)]
    try:
        for d in range(2):
            dp, dplan = _ssm(2, d, _gdn(), name=f"D{d}")
            got = exchange_handshake("127.0.0.1", servers[0].port, dp)
            mapping, pairs, _ = tp_pair_plans(dp, dplan, [got])
            # D rank d reads Q/K/V halves and its two ssm heads of P's page (layer 0 at 0)
            want = [(0 + 48 * d, 48), (96 + 48 * d, 48), (192 + 96 * d, 96), (384 + 256 * d, 256)]
            rd = pairs[0].remote.descriptors()
            assert [(int(a) - 0x1000, int(n)) for a, n, _ in rd[::4][:4]] == want
            assert mapping.slices[0][0].ranges[0][1] == 0
    finally:
        for s in servers:
            s.close()


def test_state_geometry_refusals_name_the_field():
    p, _ = _ssm(1, 0, _gdn())
    # DS/SD mix: refused at any TP, naming the env var
    for tp in (1, 2):
        d, _ = _ssm(tp, 0, _gdn("SD"))
        with pytest.raises(HandshakeError, match="Mamba state geometry: conv_layout local 'SD', "
                                                 "remote 'DS'.*VLLM_SSM_CONV_STATE_LAYOUT"):
            d.check_compatible(p)
    # no geometry on one side: equal TP pairs (whole pages), other TP refused by name
    nog1, _ = _ssm(1, 0, None, page=960)
    nog1.check_compatible(p)
    p.check_compatible(nog1)
    nog2, _ = _ssm(2, 0, None)
    with pytest.raises(HandshakeError, match="group 0 is Mamba state and the TP sizes differ "
                                             r"\(local 2, remote 1\) but the local side sent no "
                                             "state geometry"):
        nog2.check_compatible(p)
    # a TP size that does not shard the state (2 k heads at TP 4)
    d4, _ = _ssm(4, 0, None, page=512)
    d4 = dataclasses.replace(d4, tp=dataclasses.replace(d4.tp, states=(_gdn().to_wire(),)))
    with pytest.raises(HandshakeError, match="local TP size 4 does not shard group 0's Mamba "
                                             "state: .*tp 4 does not divide"):
        d4.check_compatible(p)
    # pages smaller than the geometry's content
    small, _ = _ssm(2, 0, _gdn(), page=256)
    with pytest.raises(HandshakeError, match=r"layer 'ssm.0' \(group 0\) has 256 B of state "
                                             r"pages on the local side \(TP 2\), less than its "
                                             "448 B"):
        small.check_compatible(p)
    # malformed geometry on the wire; an older peer is refused by the version rule
    d = json.loads(p.to_bytes())
    d["tp"]["states"] = [dict(_gdn().to_wire(), conv_rows=0)]
    with pytest.raises(HandshakeError, match="peer state geometry is malformed: .*conv_rows"):
        HandshakePayload.from_bytes(json.dumps(d).encode())
    d = json.loads(p.to_bytes())
    del d["tp"]["states"]
    d["version"] = 4
    with pytest.raises(HandshakeError, match="peer speaks handshake version 4, this side 5"):
        HandshakePayload.from_bytes(json.dumps(d).encode())
    with pytest.raises(HandshakeError, match="states must hold one entry per group"):
        dataclasses.replace(p.tp, states=(None, None))
