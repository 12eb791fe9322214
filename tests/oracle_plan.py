"""Plain-Python oracle for descriptor-id flattening (vllm-hma.md §4.5 / §11.1), no NumPy tricks.

Regions are given as plain tuples ``(logical_blocks, ratio, group, state)`` in dlist order.
"""


def oracle_desc_ids(regions, group_state, block_ids, *, group_major, kernel_ids=False):
    """Descriptor ids as a Python list of ints.

    regions: [(logical_blocks, ratio, group (-1 shared), state bool)]; group_state: [bool] per
    group (True = Mamba). block_ids: per group lists (validated by the caller).
    """
    offsets, acc = [], 0
    for logical, ratio, _, state in regions:
        offsets.append(acc)
        acc += logical * (1 if state else ratio)

    def serves(r, g):
        _, _, owner, state = regions[r]
        return bool(state) == bool(group_state[g]) and owner in (-1, g)

    def run(r, ids):
        _, ratio, _, state = regions[r]
        if state or kernel_ids or ratio == 1:
            return [offsets[r] + b for b in ids]
        return [offsets[r] + b * ratio + k for b in ids for k in range(ratio)]

    out = []
    if group_major:
        for g, ids in enumerate(block_ids):
            if len(ids) == 0:
                continue
            for r in range(len(regions)):
                if serves(r, g):
                    out += run(r, ids)
    else:
        for r in range(len(regions)):
            for g, ids in enumerate(block_ids):
                if len(ids) and serves(r, g):
                    out += run(r, ids)
    return out


def oracle_descriptors(regions_geo):
    """(addr, len, dev) rows for regions given as (base, block_len, stride, logical, ratio, dev)."""
    rows = []
    for base, block_len, stride, logical, ratio, dev in regions_geo:
        sub = block_len // ratio
        for b in range(logical):
            for k in range(ratio):
                rows.append((base + b * stride + k * sub, sub, dev))
    return rows
