"""A NIXL peer process for the two-process tests (run with subprocess, never forked).

argv[1] is a JSON object ``{"agents": [cfg, ...], "serve_s": S}``; each cfg has name, preset
(or layout: KVLayout.to_dict()), num_blocks, page_bytes, kernel_block_size, state_parts,
kv_split, hma, fill_table (per-group ids to fill with the pattern). The process hosts one
agent and one handshake server per cfg, prints ``{"ports": {name: port}}``, accepts every
compatible client as a NIXL peer, and answers notifications ``b"<req>:verify:<json>"`` (json
= [table, positions]) with ``ok`` or ``bad``; ``b"<req>:bye"`` ends it; S bounds its life.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hmacore.demo.paged_memory import allocate_paged_kv, fill_pattern, verify_pattern  # noqa: E402
from hmacore.plan import TransferPlan  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.spec import KVLayout  # noqa: E402
from hmacore.transport.handshake import HandshakeServer  # noqa: E402
from hmacore.transport.nixl import NixlAgent  # noqa: E402


class Hosted:
    def __init__(self, cfg):
        layout = KVLayout.from_dict(cfg["layout"]) if "layout" in cfg else get_preset(cfg["preset"])
        nb = cfg["num_blocks"]
        self.paged = allocate_paged_kv(layout, nb, page_bytes=cfg.get("page_bytes"),
                                       kv_split=cfg.get("kv_split", False),
                                       state_parts=cfg.get("state_parts", 2))
        if cfg.get("fill_table"):
            fill_pattern(self.paged, cfg["fill_table"])
        plan = TransferPlan.from_kv_caches(layout, self.paged.kv_caches, num_blocks=nb,
                                           kernel_block_size=cfg.get("kernel_block_size"))
        self.agent = NixlAgent(cfg["name"], plan, hma=cfg.get("hma", True))
        self.pending = []
        self.server = HandshakeServer(self.agent.handshake_payload(), on_peer=self.pending.append)
        self.client = None

    def step(self) -> bool:
        """Serve once; False when told to stop."""
        while self.pending:
            self.client = self.agent.add_peer(self.pending.pop(0))
        self.agent._drain_notifs()
        for req in list(self.agent._notifs):
            for body in self.agent.notifications(req):
                if body == b"bye":
                    return False
                if body.startswith(b"verify:") and self.client is not None:
                    table, positions = json.loads(body[len(b"verify:"):])
                    bad = verify_pattern(self.paged, table, positions)
                    self.agent.send_notif(self.client, req, b"ok" if not bad else b"bad")
        return True

    def close(self):
        self.server.close()
        self.agent.close()


def main() -> int:
    args = json.loads(sys.argv[1])
    hosted = [Hosted(cfg) for cfg in args["agents"]]
    print(json.dumps({"ports": {h.agent.name: h.server.port for h in hosted}}), flush=True)
    deadline = time.monotonic() + args.get("serve_s", 30)
    try:
        while time.monotonic() < deadline:
            if not all([h.step() for h in hosted]):
                return 0
            time.sleep(0.002)
        return 3
    finally:
        for h in hosted:
            h.close()


if __name__ == "__main__":
    sys.exit(main())
