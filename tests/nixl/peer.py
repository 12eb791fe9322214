"""A NIXL peer process for the two-process tests (run with subprocess, never forked).

argv[1] is a JSON object: name, preset, num_blocks, page_bytes, kernel_block_size, state_parts,
kv_split, fill_table (per-group ids to fill with the pattern), serve_s (hard lifetime bound).
It prints ``{"port": P}`` once its handshake server listens, accepts every compatible client
as a NIXL peer, and answers notifications ``b"<req>:verify:<json>"`` (json = [table,
positions]) with ``ok`` or ``bad``; ``b"<req>:bye"`` ends it.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hmacore.paged import allocate_paged_kv, fill_pattern, verify_pattern  # noqa: E402
from hmacore.plan import TransferPlan  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.transport.handshake import HandshakeServer  # noqa: E402
from hmacore.transport.nixl import NixlAgent  # noqa: E402


def main() -> int:
    args = json.loads(sys.argv[1])
    layout = get_preset(args["preset"])
    nb = args["num_blocks"]
    paged = allocate_paged_kv(layout, nb, page_bytes=args.get("page_bytes"),
                              kv_split=args.get("kv_split", False),
                              state_parts=args.get("state_parts", 2))
    if args.get("fill_table"):
        fill_pattern(paged, args["fill_table"])
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb,
                                       kernel_block_size=args.get("kernel_block_size"))
    agent = NixlAgent(args["name"], plan, hma=args.get("hma", True))
    pending = []
    server = HandshakeServer(agent.handshake_payload(), on_peer=pending.append)
    print(json.dumps({"port": server.port}), flush=True)
    deadline = time.monotonic() + args.get("serve_s", 30)
    client = None
    try:
        while time.monotonic() < deadline:
            while pending:
                client = agent.add_peer(pending.pop(0))
            agent._drain_notifs()
            for req in list(agent._notifs):
                for body in agent.notifications(req):
                    if body == b"bye":
                        return 0
                    if body.startswith(b"verify:") and client is not None:
                        table, positions = json.loads(body[len(b"verify:"):])
                        bad = verify_pattern(paged, table, positions)
                        agent.send_notif(client, req, b"ok" if not bad else b"bad")
            time.sleep(0.002)
        return 3
    finally:
        server.close()
        agent.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # NIXL 1.5.1's bundled libnl-route segfaults in its ELF finalizer at exit; skip finalizers.
    os._exit(code)
