"""The prefill (source) side of a block-size remap over real NIXL, as its own process.

argv[1] is JSON ``{"name", "scenario", "num_tokens", "trim", "seed", "serve_s"}``: the peer
rebuilds the scenario's world (tests/regrain_scenarios.World, deterministic from the seed),
registers the source memory, prints ``{"ports": {name: port}}`` and serves remap handshakes.
Notifications ``b"<req>:untouched"`` are answered ``ok``/``bad`` (the source memory still
equals what it was when built); ``b"<req>:bye"`` ends it; serve_s bounds its life.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

from hmacore.transport.handshake import HandshakeServer, check_regrain_compatible  # noqa: E402
from hmacore.transport.nixl import NixlAgent  # noqa: E402
from regrain_scenarios import World  # noqa: E402


def main() -> int:
    args = json.loads(sys.argv[1])
    w = World(args["scenario"], args["num_tokens"], args["trim"], args["seed"])
    snapshot = [s.copy() for s in w.spaged.storages]
    agent = NixlAgent(args["name"], w.splan)
    pending: list = []
    payload = agent.handshake_payload()
    server = HandshakeServer(payload, on_peer=pending.append,
                             check=check_regrain_compatible(payload))
    print(json.dumps({"ports": {args["name"]: server.port}}), flush=True)
    deadline = time.monotonic() + args.get("serve_s", 40)
    client = None
    try:
        while time.monotonic() < deadline:
            while pending:
                client, _ = agent.add_regrain_peer(pending.pop(0), w.dlay)
            agent._drain_notifs()
            for req in list(agent._notifs):
                for body in agent.notifications(req):
                    if body == b"bye":
                        return 0
                    if body == b"untouched" and client is not None:
                        same = all((a == b).all() for a, b in zip(w.spaged.storages, snapshot))
                        agent.send_notif(client, req, b"ok" if same else b"bad")
            time.sleep(0.002)
        return 3
    finally:
        server.close()
        agent.close()


if __name__ == "__main__":
    sys.exit(main())
