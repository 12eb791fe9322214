"""Handshake payloads and the loopback exchange (no NIXL needed: metadata is opaque bytes)."""
import dataclasses
import json
import socket

import pytest

from hmacore.errors import HandshakeError
from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.transport.handshake import (PROTOCOL_VERSION, HandshakePayload, HandshakeServer,
                                         exchange_handshake)


def _payload(name="p", preset="gpt-oss", page=64, nb=8, hma=True, **kw):
    layout = get_preset(preset)
    paged = allocate_paged_kv(layout, nb, page_bytes=page, **kw)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    return HandshakePayload.for_plan(plan, name, b"\x00meta-" + name.encode(), hma=hma), plan


def test_roundtrip_and_remote_plan():
    p, plan = _payload()
    q = HandshakePayload.from_bytes(p.to_bytes())
    assert q == p and q.version == PROTOCOL_VERSION
    remote = q.remote_plan(plan.layout)
    assert remote.regions == plan.regions


def test_compat_hash_ignores_addresses_and_pool_size():
    a, _ = _payload("a", nb=8)
    b, _ = _payload("b", nb=32)
    assert a.regions[0]["base"] != b.regions[0]["base"]
    assert a.compatibility_hash == b.compatibility_hash
    a.check_compatible(b)


@pytest.mark.parametrize("other_kw, match", [
    ({"hma": False}, "HMA"),
    ({"preset": "gemma-3"}, "fingerprint"),
    ({"page": 128}, "region shapes"),
    ({"kv_split": True}, "region count"),
])
def test_incompatible_peers(other_kw, match):
    a, _ = _payload("a")
    b, _ = _payload("b", **other_kw)
    with pytest.raises(HandshakeError, match=match):
        a.check_compatible(b)


def test_tampered_or_malformed_payload():
    p, _ = _payload()
    d = json.loads(p.to_bytes())
    d["regions"][0]["block_len"] = 32
    with pytest.raises(HandshakeError, match="does not match"):
        HandshakePayload.from_bytes(json.dumps(d).encode())
    with pytest.raises(HandshakeError, match="malformed"):
        HandshakePayload.from_bytes(b"{not json")
    with pytest.raises(HandshakeError, match="malformed"):
        HandshakePayload.from_bytes(b'{"version": 1}')
    v2 = dataclasses.replace(p, version=PROTOCOL_VERSION + 1)
    with pytest.raises(HandshakeError, match="version"):
        HandshakePayload.from_bytes(v2.to_bytes())


def test_exchange_over_loopback():
    server_p, _ = _payload("server")
    client_p, _ = _payload("client", nb=16)
    seen = []
    with HandshakeServer(server_p, on_peer=seen.append) as srv:
        got = exchange_handshake("127.0.0.1", srv.port, client_p)
        assert got == server_p
        bad, _ = _payload("bad", hma=False)
        with pytest.raises(HandshakeError, match="rejected.*HMA"):
            exchange_handshake("127.0.0.1", srv.port, bad)
        # the server keeps serving after a rejection
        assert exchange_handshake("127.0.0.1", srv.port, client_p) == server_p
    assert [p.agent_name for p in seen] == ["client", "client"]
    assert len(srv.errors) == 1 and "HMA" in srv.errors[0]


def test_refused_and_timeout_are_bounded():
    p, _ = _payload()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(HandshakeError, match="failed"):
        exchange_handshake("127.0.0.1", port, p, timeout=1.0)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1)  # accepts connections in the backlog, never answers
    try:
        with pytest.raises(HandshakeError, match="failed"):
            exchange_handshake("127.0.0.1", mute.getsockname()[1], p, timeout=0.3)
    finally:
        mute.close()


@pytest.mark.parametrize("field,value", [("hma", "false"), ("hma", 1), ("num_blocks", 63.9),
                                         ("regions.state", "false"), ("regions.block_len", 2.5)])
def test_wire_fields_are_strictly_typed(field, value):
    """A peer's ``"state": "false"`` is refused, never read as True (bool("false") is True);
    floats are refused, never truncated."""
    import json

    from hmacore.plan import TransferPlan
    from hmacore.presets import get_preset
    from hmacore.transport.handshake import HandshakePayload
    plan = TransferPlan.from_layout(get_preset("gpt-oss-120b", num_blocks=64))
    d = json.loads(HandshakePayload.for_plan(plan, "a", b"m").to_bytes())
    if field.startswith("regions."):
        d["regions"][0][field.split(".")[1]] = value
    else:
        d[field] = value
    with pytest.raises(HandshakeError, match=field.split(".")[-1]):
        HandshakePayload.from_bytes(json.dumps(d).encode())
