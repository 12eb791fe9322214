"""The NIXL driver behind the transport interface (hmacore.transport.base): built by
make_transport("nixl", ...), an instance of KvTransport, a READ and a WRITE through the
interface's methods move exactly the requested pages."""
import numpy as np
import pytest

from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.transport.base import KvTransport, Transfer, make_transport
from hmacore.transport.nixl import NixlAgent

pytestmark = pytest.mark.nixl

NB, PAGE = 32, 512
LAYOUT = KVLayout(groups=(
    GroupSpec(GroupKind.FULL, 16, ("m.f.0", "m.f.1")),
    GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("m.s.0", "m.s.1"), sliding_window=32)))


def _side(seed):
    mem = np.random.default_rng(seed).integers(0, 256, (4, NB, PAGE), dtype=np.uint8)
    kv = {n: mem[j] for j, n in enumerate(("m.f.0", "m.f.1", "m.s.0", "m.s.1"))}
    return mem, TransferPlan.from_kv_caches(LAYOUT, kv, num_blocks=NB)


def test_nixl_through_the_interface():
    (am, aplan), (bm, bplan) = _side(1), _side(2)
    a = make_transport("nixl", "iface-a", aplan)
    b = make_transport("nixl", "iface-b", bplan)
    try:
        assert isinstance(a, NixlAgent) and isinstance(a, KvTransport)
        peer = a.add_peer(b.handshake_payload())
        b.add_peer(a.handshake_payload())
        before_a = am.copy()
        local, remote = [[3, 4, 5], [9]], [[20, 7, 8], [30]]
        t = a.wait(a.read("rq", peer, local, remote, notif=b"got"), timeout=30)
        assert isinstance(t, Transfer) and t.state == "DONE"
        assert b.wait_notif("rq", timeout=30) == b"got"
        expect = before_a.copy()
        for layers, lg, rg in (((0, 1), local[0], remote[0]), ((2, 3), local[1], remote[1])):
            for j in layers:
                expect[j, lg] = bm[j, rg]
        assert np.array_equal(am, expect)          # exactly those pages, nothing else
        before_b = bm.copy()
        t = a.wait(a.write("wq", peer, [[1, 2], [6]], [[10, 11], [12]]), timeout=30)
        assert t.state == "DONE" and a.valid_blocks("wq") is not None
        expect_b = before_b.copy()
        for layers, lg, rg in (((0, 1), [1, 2], [10, 11]), ((2, 3), [6], [12])):
            for j in layers:
                expect_b[j, rg] = am[j, lg]
        assert np.array_equal(bm, expect_b)
    finally:
        a.close()
        b.close()


def test_unknown_transport_refused_before_anything_is_built():
    _, plan = _side(3)
    with pytest.raises(ValueError, match=r"transport must be one of \['nixl', 'mooncake'\]"):
        make_transport("ucx", "x", plan)
