"""Embedding hmacore in a scheduler that is not vLLM: the bookkeeping of one P/D hand-off and
one store lookup, with numpy only (no NIXL, no vLLM). Run: python docs/examples/embed_scheduler.py
"""
import numpy as np

from hmacore import GroupKind, GroupSpec, KVLayout
from hmacore.hits import ExistenceSet, HitFinder
from hmacore.plan import TransferPlan
from hmacore.tables import TrackerSet, fill_blocks, to_wire
from hmacore.windows import clip_to_window, trim_remote_to_local

# 1. Describe the model's KV cache groups once (or KVLayout.from_file("model.toml")).
layout = KVLayout(num_blocks=4096, groups=(
    GroupSpec(GroupKind.FULL, 16, ("l0", "l2"), page_bytes=4096, name="full"),
    GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("l1", "l3"), sliding_window=64, page_bytes=4096,
              name="swa"),
))

# 2. Prefill side: track the request's per-group table; at finish, clip what decode needs.
p_trackers = TrackerSet(layout)
p_table = [list(range(1, 11)), [0, 0, 0, 0, 0, 31, 32, 33, 34, 35]]   # 150 tokens, window 64
p_trackers.add("req-1", p_table, num_prompt_tokens=150)
remote = clip_to_window(p_trackers.finish("req-1"), layout)         # windows: last 5 blocks
wire = to_wire(remote)                                               # JSON-ready list[list[int]]
assert wire == [list(range(1, 11)), [31, 32, 33, 34, 35]]

# 3. Decode side: the blocks to fill are the unhashed, non-null ones; pair them with P's.
d_table = [list(range(101, 111)), [0, 0, 0, 0, 0, 131, 132, 133, 134, 135]]
hashed = [np.zeros(10, np.uint8), np.zeros(10, np.uint8)]
hashed[0][:4] = 1                                                    # 4 blocks cached locally
local = clip_to_window(fill_blocks(d_table, hashed), layout)
local, remote = trim_remote_to_local(local, wire, layout)
assert [list(g) for g in remote] == [list(range(5, 11)), [31, 32, 33, 34, 35]]

# 4. Descriptor ids for a NIXL READ (identical order on both peers).
plan = TransferPlan.from_layout(layout)                              # or .from_kv_caches(...)
ids = plan.desc_ids(local)
assert ids.dtype == np.int64 and ids.size == 2 * (6 + 5)             # 2 shared regions

# 5. External cache hit: which prefix of a new request a store already holds.
finder = HitFinder(layout)
hashes = np.random.default_rng(0).integers(0, 256, (12, 32), dtype=np.uint8)  # 12 x 16 tokens
cached = ExistenceSet(32)
for g in (0, 1):
    for row in range(8):                                             # first 128 tokens stored
        cached.add(g, hashes[row].tobytes())
hit = finder.longest_hit(hashes, cached, max_length=191)
assert hit.tokens == 128
print("ok: clip, select, trim, desc ids, longest hit =", hit.tokens, "tokens")
