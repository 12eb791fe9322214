"""Block-size remap over real NIXL between two processes: the prefill peer (its own process,
block size bp) holds token-tagged pages; this process (decode, block size bd) READs the byte
runs hmacore.regrain computes and checks every byte of its memory: the moved token rows carry
the source's tags, nothing else changed; the peer checks its own memory is untouched."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hmacore.errors import HandshakeError
from hmacore.transport.handshake import check_regrain_compatible, exchange_handshake
from hmacore.transport.nixl import NixlAgent

from conftest import Peer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from regrain_scenarios import World  # noqa: E402

pytestmark = pytest.mark.nixl
PEER = os.path.join(os.path.dirname(__file__), "regrain_peer.py")

CASES = [("gemma_p16_d32", 130, 0), ("gemma_p64_d16", 129, 16), ("dsv4_p1x_d4x", 200, 64),
         ("dsv4_p4x_d1x", 77, 0), ("qwen_next_p16_d64", 130, 32),
         ("lbhnc_p8_d32_kernel16", 77, 0)]


class RegrainPeer(Peer):
    def __init__(self, cfg):   # Peer's bounded start/kill, our script
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
        self.proc = subprocess.Popen([sys.executable, PEER, json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._ports = None


@pytest.fixture
def peers():
    made = []
    yield made
    for p in made:
        p.kill()


@pytest.mark.parametrize("scenario, num_tokens, trim", CASES)
def test_pull_remapped_every_byte(peers, scenario, num_tokens, trim):
    seed = num_tokens * 7 + trim
    name = f"rg-p-{scenario}"
    peer = RegrainPeer({"name": name, "scenario": scenario, "num_tokens": num_tokens,
                        "trim": trim, "seed": seed, "serve_s": 60})
    peers.append(peer)
    w = World(scenario, num_tokens, trim, seed)
    want = w.expected()
    with NixlAgent(f"rg-d-{scenario}", w.dplan) as agent:
        mine = agent.handshake_payload()
        payload = exchange_handshake("127.0.0.1", peer.ports[name], mine,
                                     check=check_regrain_compatible(mine))
        pname, splan = agent.add_regrain_peer(payload, w.slay)
        assert [r.block_len for r in splan.regions] == [r.block_len for r in w.splan.regions]
        w.splan = splan          # the peer's addresses (its process), same shapes as our copy
        before = [s.copy() for s in w.dpaged.storages]
        runs = w.runs().as_runs("dst")
        t = agent.read_runs("req-1", pname, runs, notif=b"moved")
        agent.wait(t, timeout=30)
        got = w.dpaged.storages
        for k, (a, b) in enumerate(zip(got, want)):
            bad = np.flatnonzero(a != b)
            assert bad.size == 0, f"storage {k}: {bad.size} bytes differ"
        assert t.bytes == runs.nbytes > 0
        agent.send_notif(pname, "req-2", b"untouched")
        assert agent.wait_notif("req-2", timeout=20) == b"ok"
        # negative control: the same runs read one byte late are caught by the same check
        for s, b in zip(w.dpaged.storages, before):
            s[...] = b
        late = runs.remote.copy()
        late[:, 0] += 1
        late[:, 1] -= 1
        local = runs.local.copy()
        local[:, 1] -= 1
        keep = local[:, 1] > 0
        t = agent.read_runs("req-3", pname, type(runs)(local[keep], late[keep], None, 0, 0))
        agent.wait(t, timeout=30)
        assert any((a != b).any() for a, b in zip(w.dpaged.storages, want))
        agent.send_notif(pname, "end", b"bye")
    assert peer.proc.wait(timeout=20) == 0


def test_remap_handshake_refuses_non_multiple_block_sizes():
    w = World("gemma_p16_d32", 40, 0, 1)
    with NixlAgent("rg-d-refuse", w.dplan) as a:
        mine = a.handshake_payload()
        other = type(mine)(**{**mine.__dict__, "agent_name": "x",
                              "block_sizes": (24, 24)})
        with pytest.raises(HandshakeError, match="integer multiple"):
            check_regrain_compatible(mine)(other)


@pytest.mark.parametrize("scenario, num_tokens, trim", [("gemma_p64_d16", 130, 0),
                                                        ("dsv4_p1x_d4x", 77, 16)])
def test_push_remapped_every_byte(scenario, num_tokens, trim):
    """Push direction (P WRITEs into D), two agents in this process: the same runs, local =
    source; every destination byte checked, the source untouched."""
    w = World(scenario, num_tokens, trim, seed=5)
    want = w.expected()
    src_before = [s.copy() for s in w.spaged.storages]
    with NixlAgent(f"rg-push-p-{scenario}", w.splan) as p, \
            NixlAgent(f"rg-push-d-{scenario}", w.dplan) as d:
        dpay, ppay = d.handshake_payload(), p.handshake_payload()
        check_regrain_compatible(ppay)(dpay)
        dname, dplan = p.add_regrain_peer(dpay, w.dlay)
        assert [r.base for r in dplan.regions] == [r.base for r in w.dplan.regions]
        runs = w.runs().as_runs("src")
        t = p.write_runs("push-1", dname, runs)
        p.wait(t, timeout=30)
        for k, (a, b) in enumerate(zip(w.dpaged.storages, want)):
            assert np.array_equal(a, b), f"storage {k} differs"
        assert all(np.array_equal(a, b) for a, b in zip(w.spaged.storages, src_before))
        # a run outside the peer's registered memory is refused, nothing posted
        bad = runs.remote.copy()
        bad[0, 0] = 8
        with pytest.raises(Exception, match="outside every registered range"):
            p.write_runs("push-2", dname, type(runs)(runs.local, bad, None, 0, 0))
        assert p.failure("push-2") is not None
