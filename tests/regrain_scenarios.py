"""Real paged memory for block-size remapping tests: two sides of one model with different
block sizes, token-tagged source bytes, and the destination bytes a correct transfer leaves.

Every byte of a source token row is a function of (layer, token position, cell) where a cell
is the row's byte in the page layout's own order (HND: part, head, byte; LBHNC: head, byte;
MLA: byte); state blocks of (layer, block id, byte). Pages are read and written through NumPy
reshapes of each block (``[kernel block, part, head, row, byte]`` ...), not through the
kernel's offset arithmetic. Used by tests/test_regrain_memory.py and tests/nixl.
"""
import numpy as np

from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import TransferPlan
from hmacore.regrain import RegrainPlan, token_page, token_ranges
from hmacore.spec import GroupKind, GroupSpec, KVLayout

KINDS = {"full": GroupKind.FULL, "swa": GroupKind.SLIDING_WINDOW, "mamba": GroupKind.MAMBA}

# name -> groups: (kind, src_bs, dst_bs, page layout, heads, head_bytes, kv, window,
#                  src kernel bs, dst kernel bs); Mamba: (kind, bs, bs, state bytes)
SCENARIOS = {
    # gemma-like: full + sliding window (window 40), classic HMA aliasing (equal pages)
    "gemma_p16_d32": [("full", 16, 32, "HND", 2, 8, 2, None, None, None),
                      ("swa", 16, 32, "HND", 2, 8, 2, 40, None, None)],
    "gemma_p64_d16": [("full", 64, 16, "HND", 2, 8, 2, None, None, None),
                      ("swa", 64, 16, "HND", 2, 8, 2, 40, None, None)],
    # vLLM 0.32 CPU pages, a kernel block smaller than the logical block on D
    "lbhnc_p8_d32_kernel16": [("full", 8, 32, "LBHNC", 2, 8, 2, None, None, 16),
                              ("swa", 8, 32, "LBHNC", 2, 8, 2, 24, None, 16)],
    # DeepSeek-V4-like: MLA groups 16/4/4/2/4 on P, x4 on D (two sliding groups share specs)
    "dsv4_p1x_d4x": [("full", 16, 64, "MLA", 1, 16, 1, None, None, None),
                     ("swa", 4, 16, "MLA", 1, 16, 1, 32, None, None),
                     ("swa", 4, 16, "MLA", 1, 16, 1, 32, None, None),
                     ("swa", 2, 8, "MLA", 1, 32, 1, 8, None, None),
                     ("swa", 4, 16, "MLA", 1, 32, 1, 32, None, None)],
    "dsv4_p4x_d1x": [("full", 64, 16, "MLA", 1, 16, 1, None, None, None),
                     ("swa", 16, 4, "MLA", 1, 16, 1, 32, None, None),
                     ("swa", 16, 4, "MLA", 1, 16, 1, 32, None, None),
                     ("swa", 8, 2, "MLA", 1, 32, 1, 8, None, None),
                     ("swa", 16, 4, "MLA", 1, 32, 1, 32, None, None)],
    # Qwen3-Next-like: full attention + Mamba state (mapped by state, not tokens)
    "qwen_next_p16_d64": [("full", 16, 64, "HND", 1, 16, 2, None, None, None),
                          ("mamba", 64, 64, 320)],
}
LAYERS = 2


def side_layout(name, side):
    groups = []
    for g, row in enumerate(SCENARIOS[name]):
        layers = tuple(f"g{g}.{j}" for j in range(LAYERS))
        kind = row[0]
        bs = row[1] if side == "src" else row[2]
        if kind == "mamba":
            groups.append(GroupSpec(GroupKind.MAMBA, bs, layers))
            continue
        kbs = row[8] if side == "src" else row[9]
        kw = {"sliding_window": row[7]} if kind == "swa" else {}
        groups.append(GroupSpec(KINDS[kind], bs, layers, mla=row[3] == "MLA",
                                kernel_block_size=kbs, **kw))
    return KVLayout(groups=tuple(groups))


def pages(name, side):
    out = []
    for row in SCENARIOS[name]:
        if row[0] == "mamba":
            out.append(None)
            continue
        bs = row[1] if side == "src" else row[2]
        kbs = row[8] if side == "src" else row[9]
        out.append(token_page(row[3], block_size=bs, heads=row[4], head_bytes=row[5], kv=row[6],
                              kernel_block_size=kbs))
    return out


def allocate(name, side, num_blocks):
    """(layout, PagedKV, TransferPlan, pages) of one side."""
    layout = side_layout(name, side)
    pg = pages(name, side)
    page_bytes = [p.block_bytes if p is not None else row[3]
                  for p, row in zip(pg, SCENARIOS[name])]
    paged = allocate_paged_kv(layout, num_blocks, page_bytes=page_bytes)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=num_blocks)
    return layout, paged, plan, pg


def _mix(key, n):
    x = (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= np.full(1, key, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)  # wraps mod 2**64
    x ^= x >> np.uint64(29)
    x *= np.uint64(0x94D049BB133111EB)
    return (x >> np.uint64(32)).astype(np.uint8)


def _row_view(arr, block_id, page, r):
    """The row ``r`` of a block as an array of its cells, in the page layout's own order."""
    blk = arr[block_id]
    kbs, kr = page.kernel_block_size, page.kernel_ratio
    k, rr = divmod(r, kbs)
    if page.layout == "HND":
        parts = len({key[0] for key, _ in page.chunks})
        heads = len(page.chunks) // parts
        hb = page.chunks[0][1]
        return blk.reshape(kr, parts, heads, kbs, hb)[k, :, :, rr, :]
    if page.layout == "LBHNC":
        heads, row = len(page.chunks), page.chunks[0][1]
        return blk.reshape(kr, heads, kbs, row)[k, :, rr, :]
    if page.layout == "MLA":
        return blk.reshape(kr, kbs, page.chunks[0][1])[k, rr, :]
    raise AssertionError(page.layout)


def write_tokens(layout, paged, pg, g, table, first, lo, hi):
    """Write the tag of every token in ``[lo, hi)`` of group g into the blocks of ``table``
    (entry i = block ``first + i``; null entries skipped)."""
    spec, page = layout.groups[g], pg[g]
    bs = spec.block_size
    for j, layer in enumerate(spec.layer_names):
        arr = paged.kv_caches[layer]
        for t in range(lo, hi):
            b = table[t // bs - first]
            if b == 0:
                continue
            view = _row_view(arr, b, page, t % bs)
            view[...] = _mix((g * 131 + j) << 40 | t, view.size).reshape(view.shape)


def write_states(layout, paged, g, ids):
    for j, layer in enumerate(layout.groups[g].layer_names):
        for b in ids:
            for p, part in enumerate(paged.kv_caches[layer]):
                part[b] = _mix((g * 131 + j) << 40 | (1 << 39) | b << 8 | p, part.shape[1])


def tables(rng, layout, lo, hi, pool, *, clip):
    """Per group (table, first): ids for the blocks covering ``[lo, hi)`` drawn from the
    side's shared pool; ``clip``: start the table at block ``lo // bs`` (else a full
    positional table, null ids for blocks wholly before ``lo``)."""
    out = []
    for g, spec in enumerate(layout.groups):
        if spec.kind == GroupKind.MAMBA:
            out.append(([pool.pop()], 0))
            continue
        bs = spec.block_size
        need = -(-hi[g] // bs)
        first = lo[g] // bs if clip else 0
        ids = [pool.pop() if (i + 1) * bs > lo[g] else 0 for i in range(first, need)]
        out.append((ids, first))
    return out


class World:
    """Both sides of one scenario, built deterministically from ``seed`` (a peer process
    rebuilds the same world): memory, plans, tables, token ranges; the source tagged, the
    destination random."""

    def __init__(self, name, num_tokens, trim, seed, num_blocks=64):
        rng = np.random.default_rng(seed)
        nb = num_blocks
        self.slay, self.spaged, self.splan, self.spg = allocate(name, "src", nb)
        self.dlay, self.dpaged, self.dplan, self.dpg = allocate(name, "dst", nb)
        self.lo, self.hi = token_ranges(self.dlay, num_tokens, trim)
        spool = [int(x) for x in rng.permutation(np.arange(1, nb))]
        dpool = [int(x) for x in rng.permutation(np.arange(1, nb))]
        self.st = tables(rng, self.slay, self.lo, self.hi, spool, clip=False)
        self.dt = tables(rng, self.dlay, self.lo, self.hi, dpool, clip=True)
        for s in self.spaged.storages:
            s[...] = rng.integers(0, 256, s.shape, dtype=np.uint8)
        for g, spec in enumerate(self.slay.groups):
            ids, first = self.st[g]
            if spec.kind == GroupKind.MAMBA:
                write_states(self.slay, self.spaged, g, ids)
            else:  # whole source blocks, rows past hi too (moving them would be a bug)
                bs = spec.block_size
                write_tokens(self.slay, self.spaged, self.spg, g, ids, first, first * bs,
                             (first + len(ids)) * bs)
        for s in self.dpaged.storages:
            s[...] = rng.integers(0, 256, s.shape, dtype=np.uint8)

    def plan(self):
        return RegrainPlan(self.slay, self.dlay, self.splan, self.dplan, self.spg, self.dpg)

    def runs(self, plan=None):
        return (plan or self.plan()).runs(
            [t for t, _ in self.st], [t for t, _ in self.dt], self.lo, self.hi,
            src_first=[f for _, f in self.st], dst_first=[f for _, f in self.dt])

    def expected(self):
        """The destination storages a correct transfer leaves (the destination memory itself
        is left as it was)."""
        before = [s.copy() for s in self.dpaged.storages]
        for g, spec in enumerate(self.dlay.groups):
            ids, first = self.dt[g]
            if spec.kind == GroupKind.MAMBA:
                for layer in spec.layer_names:
                    for p, part in enumerate(self.dpaged.kv_caches[layer]):
                        part[ids[0]] = self.spaged.kv_caches[layer][p][self.st[g][0][0]]
            else:
                write_tokens(self.dlay, self.dpaged, self.dpg, g, ids, first, self.lo[g],
                             self.hi[g])
        want = [s.copy() for s in self.dpaged.storages]
        for s, b in zip(self.dpaged.storages, before):
            s[...] = b
        return want


def run_scenario(name, num_tokens, trim, seed, copy):
    """Build the world, ``copy(runs, src paged, dst paged)`` the bytes, and return
    ``(got storages, expected storages, runs, world)``."""
    w = World(name, num_tokens, trim, seed)
    want = w.expected()
    runs = w.runs()
    copy(runs, w.spaged, w.dpaged)
    return [s.copy() for s in w.dpaged.storages], want, runs, w
