"""Versioned peer handshake over a loopback TCP socket (no NIXL import here).

Each side sends one length-prefixed JSON frame: protocol version, agent name and NIXL agent
metadata, layout fingerprint, HMA on/off, block sizes, pool size, memory type and the region
table of its transfer plan. A compatibility hash covers everything both peers must agree on
(version, fingerprint, HMA flag, block sizes and each region's shape: block bytes, descriptors
per block, owning group, state flag) but not addresses or pool sizes, which legitimately
differ. Any mismatch, malformed frame, refused connection or timeout raises HandshakeError.

Heterogeneous TP (``HandshakePayload.for_tp_plan``): the payload also carries a
:class:`TpDescription` (TP size and rank, per-group head sharding, KV dtype, head dim, page
layout, the side's own layout). Region shapes then legitimately differ (pages scale with heads
per rank; block sizes may differ by one whole ratio), so the compatibility hash covers the
TP-invariant fingerprint instead (:func:`tp_fingerprint_fields`: group kinds, windows, MLA and
Mamba flags, layer->group map, total KV heads and chunks per group, dtype, head dim, page
layout), and :meth:`HandshakePayload.check_compatible` additionally checks the block sizes
(equal, or one whole ratio for every attention group), that each side's TP size fits every
group's heads, and that every layer's bytes per head per token agree between the two sides'
region tables. Each mismatch raises HandshakeError naming the field. Both peers must be
TP-aware, or neither.

Mamba state groups (protocol 5): ``TpDescription.states`` carries, per group, the
TP-independent state geometry (:class:`hmacore.state_tp.GlobalStateGeometry` wire dict) or
None. When both sides send one they must be equal (field named: a DS/SD conv layout mix is
refused, also at equal TP); between different TP sizes both must send one, both TP sizes
must shard it, and each side's state regions must hold its per-rank content. At equal TP a
group without geometry on either side still pairs as whole pages.
"""
from __future__ import annotations

import base64
import dataclasses
import fractions
import hashlib
import json
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import HandshakeError, HmacoreError
from ..plan import TransferPlan
from ..spec import GroupKind, KVLayout
from ..state_tp import GlobalStateGeometry
from ..tp import PAGE_LAYOUTS, kv_heads_of_rank

__all__ = ["PROTOCOL_VERSION", "HandshakePayload", "HandshakeServer", "TpDescription",
           "exchange_handshake", "tp_fingerprint_fields", "check_regrain_compatible"]

PROTOCOL_VERSION = 5  # 2: optional TP description (heterogeneous TP); 3: READs confirmed;
# 4: push cancels acknowledged (<push_id>:CANCEL:<agent> / <push_id>:CANCELLED:<agent>);
# 5: TpDescription.states (Mamba state geometry per group, state pages across TP sizes)



def _wire_bool(value: Any, name: str) -> bool:
    """A boolean field of a peer's payload: JSON true/false only (``bool("false")`` is True,
    so a string or number here would silently flip a layout rule)."""
    if not isinstance(value, bool):
        raise HandshakeError(f"handshake field {name} must be true or false, got {value!r}")
    return value


def _wire_region(r: Any) -> dict[str, Any]:
    """One entry of a peer's region table, its typed fields checked (the plan rebuilt from it
    and the compatibility hash read them)."""
    r = dict(r)
    for key in ("base", "block_len", "stride", "logical_blocks", "ratio", "group"):
        _wire_int(r.get(key), f"regions.{key}")
    _wire_bool(r.get("state"), "regions.state")
    return r


def _wire_int(value: Any, name: str) -> int:
    """An integer field of a peer's payload: JSON integers only (no floats, no bools)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise HandshakeError(f"handshake field {name} must be an integer, got {value!r}")
    return value

@dataclasses.dataclass(frozen=True)
class TpDescription:
    """What a TP-aware peer adds to its handshake payload.

    Attributes:
        tp_size / tp_rank: this side's TP world size and rank.
        shardings: per group ``(num_heads, chunks, replicated)`` as hmacore.tp.GroupSharding:
            total KV heads of a layer (total state heads for sharded Mamba), head-major chunks
            per block, replicated (MLA; unsharded Mamba).
        layout: this side's ``KVLayout.to_dict()`` (its own block sizes).
        kv_dtype: KV cache dtype name (e.g. ``"bfloat16"``, ``"fp8_e4m3"``).
        head_dim: head size in elements.
        page_layout: vLLM KV cache layout of the pages (one of hmacore.tp.PAGE_LAYOUTS).
        states: per group None or the state geometry wire dict
            (``GlobalStateGeometry.to_wire()``); empty = None for every group.
    """

    tp_size: int
    tp_rank: int
    shardings: tuple[tuple[int, int, bool], ...]
    layout: dict[str, Any]
    kv_dtype: str
    head_dim: int
    page_layout: str = "HND"
    states: tuple[dict[str, Any] | None, ...] = ()

    def __post_init__(self) -> None:
        for name, v, lo in (("tp_size", self.tp_size, 1), ("tp_rank", self.tp_rank, 0),
                            ("head_dim", self.head_dim, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise HandshakeError(f"TP description: {name} must be an int >= {lo}, got {v!r}")
        if self.tp_rank >= self.tp_size:
            raise HandshakeError(f"TP description: tp_rank {self.tp_rank} is not in "
                                 f"[0, {self.tp_size})")
        if self.page_layout not in PAGE_LAYOUTS:
            raise HandshakeError(f"TP description: page_layout must be one of "
                                 f"{list(PAGE_LAYOUTS)}, got {self.page_layout!r}")
        if not isinstance(self.kv_dtype, str) or not self.kv_dtype:
            raise HandshakeError(f"TP description: kv_dtype must be a non-empty str, "
                                 f"got {self.kv_dtype!r}")
        n = len(self.layout.get("groups", ())) if isinstance(self.layout, dict) else -1
        if len(self.shardings) != n:
            raise HandshakeError(f"TP description: {len(self.shardings)} shardings for "
                                 f"{n} groups")
        states = tuple(self.states) if isinstance(self.states, (list, tuple)) else None
        if states == ():
            states = (None,) * n
        if states is None or len(states) != n:
            raise HandshakeError(f"TP description: states must hold one entry per group ({n}), "
                                 f"got {self.states!r}")
        for g, st in enumerate(states):
            if st is not None:
                GlobalStateGeometry.from_wire(st)       # HandshakeError naming the key
                if not self.shardings[g][2]:
                    raise HandshakeError(f"TP description: group {g} has a state geometry but "
                                         "is not declared replicated (whole pages at equal TP)")
        object.__setattr__(self, "states", states)

    def state_geometry(self, g: int) -> GlobalStateGeometry | None:
        """Group ``g``'s state geometry, or None."""
        st = self.states[g]
        return None if st is None else GlobalStateGeometry.from_wire(st)

    def kv_layout(self) -> KVLayout:
        """This side's layout (HandshakeError if the document is malformed)."""
        try:
            return KVLayout.from_dict(self.layout)
        except (HmacoreError, TypeError, ValueError, KeyError) as e:
            raise HandshakeError(f"TP description: malformed layout: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shardings"] = [list(s) for s in self.shardings]
        d["states"] = [None if st is None else dict(st) for st in self.states]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TpDescription:
        return cls(int(d["tp_size"]), int(d["tp_rank"]),
                   tuple((_wire_int(h, "shardings.num_heads"), _wire_int(k, "shardings.chunks"),
                          _wire_bool(r, "shardings.replicated")) for h, k, r in d["shardings"]),
                   dict(d["layout"]), str(d["kv_dtype"]), int(d["head_dim"]),
                   str(d.get("page_layout", "HND")),
                   # absent before protocol 5: the version rule then refuses the peer by name
                   tuple(d.get("states") or ()))


def tp_fingerprint_fields(tp: TpDescription) -> list[tuple[str, Any]]:
    """``(field, value)`` pairs two TP-aware peers must agree on whatever their TP sizes:
    kv_dtype, head_dim, page_layout, context parallelism, group count and per group kind, MLA
    flag, window / chunk / retained tokens, EAGLE, Mamba mode and speculative slots, transfer
    flag, layer names (the layer->group map), total heads, chunks and replication. Not block
    sizes, kernel block sizes or page bytes (they depend on the block size and TP size)."""
    lay = tp.kv_layout()
    out: list[tuple[str, Any]] = [("kv_dtype", tp.kv_dtype), ("head_dim", tp.head_dim),
                                  ("page_layout", tp.page_layout),
                                  ("context_parallel", lay.context_parallel),
                                  ("group count", lay.num_groups)]
    for g, (s, (h, k, repl)) in enumerate(zip(lay.groups, tp.shardings)):
        out += [(f"group {g} kind", s.kind.name), (f"group {g} mla", s.mla),
                (f"group {g} sliding_window", s.sliding_window),
                (f"group {g} chunk_size", s.chunk_size),
                (f"group {g} extra_retained_tokens", s.extra_retained_tokens),
                (f"group {g} eagle", s.eagle), (f"group {g} mamba_mode", s.mamba_mode.name),
                (f"group {g} num_speculative_blocks", s.num_speculative_blocks),
                (f"group {g} transfer", s.transfer),
                (f"group {g} layer names", list(s.layer_names)),
                (f"group {g} replicated", repl),
                (f"group {g} total KV heads", None if repl else h),
                (f"group {g} chunks per block", None if repl else k)]
    return out


def _tp_unit_bytes(tp: TpDescription, regions: tuple[dict[str, Any], ...]
                   ) -> dict[str, list[tuple[bool, fractions.Fraction]]]:
    """Per layer: (state, bytes per head per token) of each region holding it, in order
    (bytes per head per block for state regions; whole page per token when replicated)."""
    lay = tp.kv_layout()
    l2g = lay.layer_to_group
    out: dict[str, list[tuple[bool, fractions.Fraction]]] = {}
    for i, r in enumerate(regions):
        try:
            blen, state = _wire_int(r["block_len"], "block_len"), _wire_bool(r["state"], "state")
            layers = list(r["layers"])
        except (KeyError, TypeError, ValueError) as e:
            raise HandshakeError(f"region {i} of the region table is malformed: {e}") from None
        for name in layers:
            g = l2g.get(name)
            if g is None:
                raise HandshakeError(f"region {i} names layer {name!r} that its layout lacks")
            h, k, repl = tp.shardings[g]
            spec = lay.groups[g]
            if repl:
                per = fractions.Fraction(blen)
            else:
                lo, hi = kv_heads_of_rank(h, tp.tp_size, tp.tp_rank)
                per = fractions.Fraction(blen, k * (hi - lo))
            if not state:
                per /= spec.block_size
            out.setdefault(name, []).append((state, per))
    return out

def _check_states(who: str, me: TpDescription, mine: tuple[dict[str, Any], ...],
                  them: TpDescription, theirs: tuple[dict[str, Any], ...], lay: KVLayout) -> None:
    """Mamba state geometries: equal when both sides send one (field named); required on both
    sides between different TP sizes, where both TP sizes must shard it and each side's state
    regions of a layer must hold at least its per-rank content."""
    cross = me.tp_size != them.tp_size
    for g, spec in enumerate(lay.groups):
        a, b = me.states[g], them.states[g]
        if a is not None and b is not None and a != b:
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            hint = (" (a DS/SD conv state mix is a transposed copy, not a byte range: set the "
                    "same VLLM_SSM_CONV_STATE_LAYOUT on both engines)"
                    if key == "conv_layout" else "")
            raise HandshakeError(f"{who} disagrees on group {g}'s Mamba state geometry: {key} "
                                 f"local {a.get(key)!r}, remote {b.get(key)!r}{hint}")
        if not cross or spec.kind != GroupKind.MAMBA or not spec.transfer:
            continue
        if a is None or b is None:
            side = "local" if a is None else "remote"
            raise HandshakeError(f"{who}: group {g} is Mamba state and the TP sizes differ "
                                 f"(local {me.tp_size}, remote {them.tp_size}) but the {side} "
                                 "side sent no state geometry (its state type is not modelled "
                                 "across TP sizes); use equal TP sizes")
        geo = GlobalStateGeometry.from_wire(a)
        for side, d, regions in (("local", me, mine), ("remote", them, theirs)):
            try:
                content = geo.at(d.tp_size).content_bytes
            except HmacoreError as e:
                raise HandshakeError(f"{who}: {side} TP size {d.tp_size} does not shard group "
                                     f"{g}'s Mamba state: {e}") from None
            per_layer: dict[str, int] = {}
            for r in regions:
                if r.get("state"):
                    for n in r.get("layers", ()):
                        if n in spec.layer_names:
                            per_layer[n] = per_layer.get(n, 0) + int(r["block_len"])
            for n in spec.layer_names:
                if per_layer.get(n, 0) < content:
                    raise HandshakeError(f"{who}: layer {n!r} (group {g}) has "
                                         f"{per_layer.get(n, 0)} B of state pages on the {side} "
                                         f"side (TP {d.tp_size}), less than its {content} B of "
                                         "state: the state geometry does not match the pages")


_MAX_FRAME = 64 << 20  # bytes; a region table of 100k regions fits easily


@dataclasses.dataclass(frozen=True)
class HandshakePayload:
    """What one peer tells the other. ``regions`` is ``TransferPlan.region_table()``;
    ``tp`` is None for same-TP peers (exact region shapes compared) or a TpDescription."""

    version: int
    agent_name: str
    agent_metadata: bytes
    layout_fingerprint: str
    hma: bool
    block_sizes: tuple[int, ...]
    num_blocks: int
    mem_type: str
    regions: tuple[dict[str, Any], ...]
    tp: TpDescription | None = None

    @classmethod
    def for_plan(cls, plan: TransferPlan, agent_name: str, agent_metadata: bytes, *,
                 hma: bool = True) -> HandshakePayload:
        """A same-TP payload: the peer must have equal region shapes."""
        return cls(PROTOCOL_VERSION, agent_name, bytes(agent_metadata), plan.layout.fingerprint(),
                   bool(hma), plan.layout.block_sizes, plan.regions[0].logical_blocks,
                   plan.mem_type, tuple(plan.region_table()))

    @classmethod
    def for_tp_plan(cls, plan: TransferPlan, agent_name: str, agent_metadata: bytes, *,
                    tp_size: int, tp_rank: int, shardings: Sequence[Any], kv_dtype: str,
                    head_dim: int, page_layout: str = "HND", hma: bool = True
                    ) -> HandshakePayload:
        """A TP-aware payload for one rank: ``plan`` is this rank's plan (pages sized for its
        heads); ``shardings`` one hmacore.tp.GroupSharding (or ``(num_heads, chunks,
        replicated)``) per group; ``kv_dtype``/``head_dim`` the model's KV dtype name and head
        size in elements. Raises HandshakeError for a bad TP description."""
        sh = tuple((int(s[0]), int(s[1]), bool(s[2])) if isinstance(s, (tuple, list))
                   else (int(s.num_heads), int(s.chunks), bool(s.replicated)) for s in shardings)
        states = tuple(None if isinstance(s, (tuple, list)) or getattr(s, "state", None) is None
                       else s.state.to_wire() for s in shardings)
        tp = TpDescription(tp_size, tp_rank, sh, plan.layout.to_dict(), kv_dtype, head_dim,
                           page_layout, states)
        return cls(PROTOCOL_VERSION, agent_name, bytes(agent_metadata), _tp_fingerprint(tp),
                   bool(hma), plan.layout.block_sizes, plan.regions[0].logical_blocks,
                   plan.mem_type, tuple(plan.region_table()), tp)

    @property
    def compatibility_hash(self) -> str:
        """Hex digest of everything two peers must agree on (not addresses, not pool sizes;
        with a TP description not region shapes or block sizes either: those are checked
        by :meth:`check_compatible` against the TP rules)."""
        if self.tp is not None:
            doc = [self.version, "tp", self.hma, _tp_fingerprint(self.tp)]
            return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]
        shape = [(int(r["block_len"]) // int(r["ratio"]), int(r["ratio"]), int(r["group"]),
                  bool(r["state"])) for r in self.regions]
        doc = [self.version, self.layout_fingerprint, self.hma, list(self.block_sizes), shape]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]

    def check_compatible(self, other: HandshakePayload) -> None:
        """Raise HandshakeError naming the first field on which the peers disagree."""
        a: Any   # the compared values: ints, strings, tuples
        b: Any
        for field, a, b in (("version", self.version, other.version),
                            ("HMA on/off", self.hma, other.hma)):
            if a != b:
                raise HandshakeError(f"peer {other.agent_name!r} disagrees on {field}: "
                                     f"local {a!r}, remote {b!r}")
        if (self.tp is None) != (other.tp is None):
            raise HandshakeError(f"peer {other.agent_name!r} disagrees on TP awareness: the "
                                 f"{'remote' if other.tp is None else 'local'} side sent no TP "
                                 "description (both peers must use for_tp_plan, or neither)")
        if self.tp is not None:
            self._check_tp(other)
            return
        for field, a, b in (("layout fingerprint", self.layout_fingerprint, other.layout_fingerprint),
                            ("block sizes", self.block_sizes, other.block_sizes),
                            ("region count", len(self.regions), len(other.regions))):
            if a != b:
                raise HandshakeError(f"peer {other.agent_name!r} disagrees on {field}: "
                                     f"local {a!r}, remote {b!r}")
        if self.compatibility_hash != other.compatibility_hash:
            raise HandshakeError(f"peer {other.agent_name!r} disagrees on region shapes "
                                 f"(compatibility hash {self.compatibility_hash} vs "
                                 f"{other.compatibility_hash})")

    def _check_tp(self, other: HandshakePayload) -> None:
        me, them = self.tp, other.tp
        assert me is not None and them is not None
        who = f"peer {other.agent_name!r}"
        mine = dict(tp_fingerprint_fields(me))
        for field, b in tp_fingerprint_fields(them):
            a: Any = mine.get(field)
            if a != b:
                if field.endswith("layer names"):
                    diff = next((f"first difference at index {i}: {x!r} vs {y!r}"
                                 for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                f"{len(a)} vs {len(b)} layers")
                    raise HandshakeError(f"{who} disagrees on {field} (layer->group map): {diff}")
                raise HandshakeError(f"{who} disagrees on {field}: local {a!r}, remote {b!r}")
        la, lb = me.kv_layout(), them.kv_layout()
        ratios = set()
        for g, (a, b) in enumerate(zip(la.groups, lb.groups)):
            if a.kind == GroupKind.MAMBA:
                # a state block is one state, at a position set by its block size: a remap
                # pairs the blocks holding the same state (hmacore.regrain; the connector
                # refuses what it cannot pair), no block-size ratio applies
                continue
            if a.block_size == b.block_size:
                ratios.add(fractions.Fraction(1))
                continue
            big, small = max(a.block_size, b.block_size), min(a.block_size, b.block_size)
            if big % small:
                raise HandshakeError(f"{who} disagrees on block sizes: group {g} has "
                                     f"{a.block_size} tokens locally, {b.block_size} remotely "
                                     "(different block sizes must be whole multiples)")
            ratios.add(fractions.Fraction(a.block_size, b.block_size))
        if len(ratios) > 1:
            raise HandshakeError(f"{who} disagrees on block sizes: local {list(la.block_sizes)}, "
                                 f"remote {list(lb.block_sizes)} (one block-size ratio must hold "
                                 "for every attention group)")
        for side, d in (("local", me), ("remote", them)):
            for g, (h, _, repl) in enumerate(d.shardings):
                if not repl:
                    try:
                        kv_heads_of_rank(h, d.tp_size, d.tp_rank)
                    except HmacoreError as e:
                        raise HandshakeError(f"{who}: {side} TP size {d.tp_size} does not fit "
                                             f"group {g}'s heads: {e}") from None
        cross = me.tp_size != them.tp_size
        _check_states(who, me, self.regions, them, other.regions, la)
        ua, ub = _tp_unit_bytes(me, self.regions), _tp_unit_bytes(them, other.regions)
        if tuple(la.block_sizes) != tuple(lb.block_sizes) or cross:
            # a remap: state pages are padded to each side's page size (vLLM: the attention
            # page), so their bytes differ; the remap plan pairs their unpadded states
            # (hmacore.regrain, src_state_bytes) and refuses what it cannot pair.
            # Different TP sizes: the per-rank state content differs too (checked against the
            # state geometry by _check_states)
            ua = {n: [x for x in v if not x[0]] for n, v in ua.items()}
            ub = {n: [x for x in v if not x[0]] for n, v in ub.items()}
        for name in sorted(set(ua) | set(ub)):
            x, y = ua.get(name), ub.get(name)
            if x != y:
                def fmt(v):
                    return "no region" if v is None else ", ".join(
                        f"{float(p):g} B per head per {'block' if st else 'token'}" for st, p in v)
                raise HandshakeError(f"{who} disagrees on region shapes of layer {name!r} "
                                     f"(group {la.layer_to_group.get(name)}): {fmt(x)} locally "
                                     f"(TP {me.tp_size}), {fmt(y)} remotely (TP {them.tp_size}); "
                                     "head size, dtype or page layout differ")
        if self.compatibility_hash != other.compatibility_hash:  # guard: fields above agreed
            raise HandshakeError(f"{who} disagrees on the TP fingerprint "
                                 f"({self.compatibility_hash} vs {other.compatibility_hash})")

    def remote_plan(self, layout: KVLayout) -> TransferPlan:
        """The peer's transfer plan (its addresses) for a layout both sides agreed on."""
        return TransferPlan.from_region_table(layout, self.regions, mem_type=self.mem_type)

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        d["block_sizes"] = list(self.block_sizes)
        d["regions"] = list(self.regions)
        d["tp"] = None if self.tp is None else self.tp.to_dict()
        d["compatibility_hash"] = self.compatibility_hash
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> HandshakePayload:
        try:
            d = json.loads(data)
            tp = None if d.get("tp") is None else TpDescription.from_dict(d["tp"])
            p = cls(int(d["version"]), str(d["agent_name"]), base64.b64decode(d["agent_metadata"]),
                    str(d["layout_fingerprint"]), _wire_bool(d["hma"], "hma"),
                    tuple(_wire_int(b, "block_sizes") for b in d["block_sizes"]),
                    _wire_int(d["num_blocks"], "num_blocks"),
                    str(d["mem_type"]), tuple(_wire_region(r) for r in d["regions"]), tp)
            claimed = d["compatibility_hash"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HandshakeError(f"malformed handshake payload: {e}") from None
        if p.version != PROTOCOL_VERSION:
            raise HandshakeError(f"peer speaks handshake version {p.version}, this side "
                                 f"{PROTOCOL_VERSION}")
        if claimed != p.compatibility_hash:
            raise HandshakeError("handshake payload's compatibility hash does not match its content")
        return p


def _tp_fingerprint(tp: TpDescription) -> str:
    doc = tp_fingerprint_fields(tp)
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError("peer closed the handshake connection early")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise HandshakeError(f"handshake frame of {n} bytes exceeds {_MAX_FRAME}")
    return _recv_exact(sock, n)


class HandshakeServer:
    """Answers handshakes on ``host:port`` (port 0 = pick one) from a background thread.

    For each client: receive its payload, check compatibility, call ``on_peer(payload)``
    (an exception refuses the client), then reply with ours (or an error frame): a client that
    heard OK is already known here, so it may transfer and be answered at once. Every socket op is bounded by
    ``timeout`` seconds. Use as a context manager or call :meth:`close`. ``check``: the
    compatibility rule (default ``payload.check_compatible``; a block-size remap passes one
    that accepts other block sizes, e.g. :func:`check_regrain_compatible`).
    """

    def __init__(self, payload: HandshakePayload, *, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 5.0, on_peer: Callable[[HandshakePayload], None] | None = None,
                 check: Callable[[HandshakePayload], None] | None = None):
        self.payload = payload
        self.check = check if check is not None else payload.check_compatible
        self.timeout = timeout
        self.on_peer = on_peer
        self.errors: list[str] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hmacore-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(self.timeout)
                try:
                    peer = HandshakePayload.from_bytes(_recv_frame(conn))
                    self.check(peer)
                    # the peer is adopted before it hears OK: a client that goes on to
                    # transfer at once (a READ whose done this side answers) is known here
                    if self.on_peer is not None:
                        try:
                            self.on_peer(peer)
                        except Exception as e:  # noqa: BLE001 - refused, the server keeps serving
                            raise HandshakeError(f"on_peer: {type(e).__name__}: {e}") from e
                    _send_frame(conn, b"OK" + self.payload.to_bytes())
                except (HmacoreError, OSError) as e:
                    self.errors.append(str(e))
                    try:
                        _send_frame(conn, b"NO" + str(e).encode())
                    except OSError:
                        pass
                    continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def __enter__(self) -> HandshakeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def exchange_handshake(host: str, port: int, local: HandshakePayload, *,
                       timeout: float = 5.0,
                       check: Callable[[HandshakePayload], None] | None = None
                       ) -> HandshakePayload:
    """Send ``local`` to the server at ``host:port``, return its payload once both sides agree
    (``check``: the compatibility rule, default ``local.check_compatible``).

    Raises HandshakeError on refusal, timeout, a malformed reply or any incompatibility.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            _send_frame(sock, local.to_bytes())
            reply = _recv_frame(sock)
    except HandshakeError:
        raise
    except OSError as e:
        raise HandshakeError(f"handshake with {host}:{port} failed: {e}") from None
    if reply[:2] == b"NO":
        raise HandshakeError(f"peer at {host}:{port} rejected the handshake: "
                             f"{reply[2:].decode(errors='replace')}")
    if reply[:2] != b"OK":
        raise HandshakeError(f"peer at {host}:{port} sent a malformed handshake reply")
    remote = HandshakePayload.from_bytes(reply[2:])
    (check if check is not None else local.check_compatible)(remote)
    return remote


def check_regrain_compatible(local: HandshakePayload) -> Callable[[HandshakePayload], None]:
    """The handshake rule of a block-size remap (:mod:`hmacore.regrain`): version, HMA and
    group count agree, no TP description, and each group's block sizes are integer multiples
    of one another (state groups: equal). The layout itself is checked when the peer is added
    (``NixlAgent.add_regrain_peer``) and the RegrainPlan is built."""
    def check(other: HandshakePayload) -> None:
        who = f"peer {other.agent_name!r}"
        if local.tp is not None or other.tp is not None:
            raise HandshakeError(f"{who}: a block-size remap handshake takes same-TP payloads")
        for field, a, b in (("version", local.version, other.version),
                            ("HMA on/off", local.hma, other.hma),
                            ("group count", len(local.block_sizes), len(other.block_sizes))):
            if a != b:
                raise HandshakeError(f"{who} disagrees on {field}: local {a!r}, remote {b!r}")
        for g, (a, b) in enumerate(zip(local.block_sizes, other.block_sizes)):
            if max(a, b) % min(a, b):
                raise HandshakeError(f"{who}: group {g} has {a}-token blocks locally, {b} "
                                     "remotely; one must be an integer multiple of the other")
    return check
