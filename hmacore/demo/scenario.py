"""What both demo processes agree on: the layout, the memory, the requests, and how vLLM would
lay out each request's per-group block table.

Units: request lengths in tokens; tables in blocks of each group; page sizes in bytes.
"""
from __future__ import annotations

import dataclasses
import json
from collections import deque
from typing import Any

from ..grain import cdiv
from ..presets import get_preset
from ..spec import GroupKind, GroupSpec, KVLayout


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One demo run's shared parameters (sent to the prefill process as JSON)."""

    preset: str | None
    layout_file: str | None
    requests: int
    tokens: int
    page_bytes: int

    def layout(self) -> KVLayout:
        if self.layout_file:
            return KVLayout.from_file(self.layout_file)
        return get_preset(self.preset)

    def page_size(self) -> int:
        """``page_bytes`` rounded up so every group's kernel ratio divides it into 16-byte parts."""
        import math
        unit = 16 * math.lcm(*(s.kernel_ratio for s in self.layout().groups))
        return -(-self.page_bytes // unit) * unit

    def request_lengths(self) -> list[int]:
        """Token counts: ``tokens`` and slightly shorter ones, so block tails are partial."""
        return [max(1, self.tokens - 37 * r) for r in range(self.requests)]

    def num_blocks(self, *, one_full_request: bool = False) -> int:
        """Pool size holding every finished request's live blocks at once (the P/D hand-off)
        or, with ``one_full_request``, every block of the longest request (the store path,
        which saves blocks while they are all live and frees each request before the next)."""
        layout = self.layout()
        if one_full_request:
            return max(sum(cdiv(n, s.block_size) for s in layout.groups)
                       for n in self.request_lengths()) + 16
        total = sum(sum(len(real_positions(s, n)) for s in layout.groups)
                    for n in self.request_lengths())
        return total + 16

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Scenario:
        return cls(**json.loads(text))


def skipped_tokens(spec: GroupSpec, num_tokens: int) -> int:
    """Tokens of a finished ``num_tokens``-token request whose blocks vLLM has freed (nulled).

    Mirrors vLLM's ``get_num_skipped_tokens``: full attention 0; sliding window
    ``n - window + 1 - extra_retained``; chunked local ``n // chunk * chunk``; Mamba ``n - 1``.
    """
    if spec.kind == GroupKind.SLIDING_WINDOW:
        return max(0, num_tokens - spec.sliding_window + 1 - spec.extra_retained_tokens)
    if spec.kind == GroupKind.CHUNKED_LOCAL:
        return num_tokens // spec.chunk_size * spec.chunk_size
    if spec.kind == GroupKind.MAMBA:
        return max(0, num_tokens - 1)
    return 0


def real_positions(spec: GroupSpec, num_tokens: int, computed_tokens: int | None = None) -> range:
    """Block positions of group ``spec`` holding a real (non-null) block for a request of
    ``num_tokens`` tokens of which ``computed_tokens`` (default: all) are computed: blocks
    vLLM has already skipped (freed to null) for the computed part are not real."""
    n = cdiv(num_tokens, spec.block_size)
    done = num_tokens if computed_tokens is None else computed_tokens
    k = min(skipped_tokens(spec, done) // spec.block_size, n)
    return range(k, n)


class BlockPool:
    """One shared pool of block ids (id 0 = null), like vLLM's: any group takes from it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    def allocate_table(self, layout: KVLayout, num_tokens: int,
                       computed_tokens: int | None = None) -> list[list[int]]:
        """A request's full per-group table as vLLM holds it once ``computed_tokens`` (default
        all) are computed: null padding where blocks were skipped, real ids elsewhere."""
        table = []
        for spec in layout.groups:
            live = real_positions(spec, num_tokens, computed_tokens)
            if len(self._free) < len(live):
                raise RuntimeError(f"block pool exhausted ({self.num_blocks} blocks)")
            table.append([0] * live.start + [self._free.popleft() for _ in live])
        return table

    def free(self, table: Any) -> None:
        for group in table:
            for b in group:
                if int(b) != 0:
                    self._free.append(int(b))

    @property
    def num_free(self) -> int:
        return len(self._free)
