"""Plain-Python oracle for hmacore.regrain: token by token, byte by byte, which destination byte
receives which source byte. Written from the page shapes, not from the kernel's arithmetic:
a named layout is an index formula over ``[kernel block, part, head, row, byte]``.

A *world* is plain data: per group a dict with ``kind`` ("full", "swa", "mamba"), ``window``,
``src_bs`` / ``dst_bs``, ``layers``, and per side a page tuple ``(layout, heads, head_start,
head_bytes, kv, kernel_bs)`` (attention) or a state block length (Mamba: ``state_len``, or per
side ``src_state_len`` / ``dst_state_len`` when the pages are padded differently, and then
``state_bytes``, the unpadded state both sides hold from each page's start); per side per
layer a region ``(base, stride, num_blocks)``.
"""
from oracle_tp import oracle_heads, oracle_source


def page_bytes(page, bs):
    """Bytes of one block of a named page (no padding)."""
    layout, heads, _h0, hb, kv, kbs = page
    per_token = {"HND": kv * heads * hb, "LBHNC": heads * kv * hb, "NHD": kv * heads * hb,
                 "LBNHC": heads * kv * hb, "MLA": hb}[layout]
    return bs * per_token


def cells(page):
    """The (key, byte) cells of one token row of a page, with their offset formula
    ``f(row_in_kernel_block) -> offset in the kernel block``."""
    layout, heads, h0, hb, kv, kbs = page
    out = {}
    if layout == "HND":
        for c in range(kv):
            for h in range(heads):
                for b in range(hb):
                    out[((c, h0 + h), b)] = (lambda r, c=c, h=h, b=b:
                                             ((c * heads + h) * kbs + r) * hb + b)
    elif layout == "LBHNC":
        for h in range(heads):
            for b in range(kv * hb):
                out[(("kv", h0 + h), b)] = lambda r, h=h, b=b: (h * kbs + r) * kv * hb + b
    elif layout == "NHD":
        for c in range(kv):
            for b in range(heads * hb):
                out[((c, None), b)] = lambda r, c=c, b=b: (c * kbs + r) * heads * hb + b
    elif layout == "LBNHC":
        for b in range(heads * kv * hb):
            out[(("kv", None), b)] = lambda r, b=b: r * heads * kv * hb + b
    else:  # MLA
        for b in range(hb):
            out[(("latent", None), b)] = lambda r, b=b: r * hb + b
    return out


def token_addr(region, block_id, bs, page, t, f):
    """Address of cell ``f`` of token ``t`` in block ``block_id`` of a region."""
    base, stride, _nb = region
    kbs = page[5]
    r = t % bs
    kernel_bytes = page_bytes(page, kbs)
    return base + block_id * stride + (r // kbs) * kernel_bytes + f(r % kbs)


def oracle_map(world, src_ids, dst_ids, lo, hi, src_first, dst_first, tp=None):
    """dict destination address -> source address for every byte the request moves.

    ``tp``: ``(num_heads per group or None, dst_tp, dst_rank, src_tp, src_rank)``: keep only
    heads the destination rank reads from this source rank (oracle_tp's rule)."""
    out = {}
    for g, grp in enumerate(world["groups"]):
        if tp is not None and grp["kind"] != "mamba" and grp.get("num_heads"):
            H = grp["num_heads"]
            _, dst_tp, d, src_tp, p = tp
            mine = {h for h in oracle_heads(H, dst_tp, d) if oracle_source(H, src_tp, d, h) == p}
        else:
            mine = None
            if tp is not None and grp["kind"] != "mamba" and tp[4] != tp[2] % tp[3]:
                continue    # a replicated group is read from rank dst_rank % src_tp only
        for layer in grp["layers"]:
            sreg = world["src_regions"][layer]
            dreg = world["dst_regions"][layer]
            if grp["kind"] == "mamba":
                # the state, not the page: a page's bytes past the state are padding
                n = grp.get("state_bytes") or grp["state_len"]
                for i, (s, d) in enumerate(zip(src_ids[g], dst_ids[g])):
                    for b in range(n):
                        out[dreg[0] + d * dreg[1] + b] = sreg[0] + s * sreg[1] + b
                continue
            scells = cells(grp["src_page"])
            dcells = cells(grp["dst_page"])
            for t in range(lo[g], hi[g]):
                sid = src_ids[g][t // grp["src_bs"] - src_first[g]]
                did = dst_ids[g][t // grp["dst_bs"] - dst_first[g]]
                for (key, b), fd in dcells.items():
                    head = key[1]
                    if mine is not None and isinstance(head, int) and head not in mine:
                        continue
                    fs = scells[(key, b)]
                    da = token_addr(dreg, did, grp["dst_bs"], grp["dst_page"], t, fd)
                    sa = token_addr(sreg, sid, grp["src_bs"], grp["src_page"], t, fs)
                    assert da not in out, f"oracle: byte {da} written twice"
                    out[da] = sa
    return out


def runs_map(runs):
    """dict destination address -> source address of a RegrainRuns (asserting no destination
    byte is written twice and rows pair up in length)."""
    out = {}
    for (sa, sn, _), (da, dn, _) in zip(runs.src.tolist(), runs.dst.tolist()):
        assert sn == dn and sn > 0
        for b in range(sn):
            assert da + b not in out, f"destination byte {da + b} written twice"
            out[da + b] = sa + b
    return out
