"""TpPeerInfo: round trip, compatibility (block-size ratio), malformed input."""
import pytest

from hmacore.errors import HandshakeError
from hmacore.plan import TransferPlan
from hmacore.tp import GroupSharding
from hmacore.transport.tp_peer import TpPeerInfo

from oracle_tp import dsv4_like_layout, full_sliding_layout, rank_pages

SH = [GroupSharding(4, 2)] * 2


def _info(bs=16, tp=2, rank=0, sh=SH, name="a"):
    lay = full_sliding_layout(bs)
    plan = TransferPlan.from_layout(lay, 4, page_bytes=rank_pages([(4, 2, False)] * 2, [bs * 4] * 2, tp))
    return TpPeerInfo.for_plan(plan, name, b"\x00meta", tp_size=tp, tp_rank=rank, shardings=sh)


def test_round_trip_and_ratio():
    a = _info()
    b = TpPeerInfo.from_bytes(a.to_bytes())
    assert b == a and b.agent_metadata == b"\x00meta"
    assert b.remote_plan(full_sliding_layout()).shape_signature() == \
        TransferPlan.from_region_table(full_sliding_layout(), a.regions).shape_signature()
    assert _info(bs=8, tp=1).block_size_ratio(_info(bs=16)) == 2
    assert _info(tp=1).block_size_ratio(_info(tp=2)) == 1


def test_incompatible_peers_are_named():
    with pytest.raises(HandshakeError, match="not a multiple of the peer's 32"):
        _info(bs=32).block_size_ratio(_info(bs=16))
    with pytest.raises(HandshakeError, match="shards heads differently"):
        _info(sh=[GroupSharding(4, 1)] * 2).block_size_ratio(_info())
    lay = dsv4_like_layout()
    plan = TransferPlan.from_layout(lay, 4, page_bytes=256)
    other = TpPeerInfo.for_plan(plan, "b", b"", tp_size=1, tp_rank=0, shardings=[GroupSharding()] * 5)
    with pytest.raises(HandshakeError, match="peer 'b' has 5 groups, local 2"):
        other.block_size_ratio(_info())


@pytest.mark.parametrize("data,msg", [
    (b"{", "malformed TP peer info"),
    (b'{"agent_name": "x"}', "malformed TP peer info"),
])
def test_malformed(data, msg):
    with pytest.raises(HandshakeError, match=msg):
        TpPeerInfo.from_bytes(data)


def test_rank_and_version_checked():
    import json
    d = json.loads(_info().to_bytes())
    d["tp_rank"] = 2
    with pytest.raises(HandshakeError, match=r"tp_rank 2 is not in \[0, 2\)"):
        TpPeerInfo.from_bytes(json.dumps(d).encode())
    d["tp_rank"], d["version"] = 0, 9
    with pytest.raises(HandshakeError, match="TP peer info version 9"):
        TpPeerInfo.from_bytes(json.dumps(d).encode())
