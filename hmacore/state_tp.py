"""Mamba / GDN state pages across different P and D tensor-parallel sizes (issue 20).

A Mamba-type layer's page (one per block) holds, from its start, the conv state then the
temporal ("ssm") state, then padding nobody reads. Per TP rank:

* the conv state is ``R`` rows (``conv_rows``) by ``C`` channels, ``C`` the concatenation of
  each conv **sub-projection**'s own TP shard (Mamba1 ``[x]``, Mamba2 ``[x | B | C]``, GDN
  ``[Q | K | V]``), not one slice of the global channel dim. Layout ``DS`` is ``(C, R)``
  (each channel's ``R`` values contiguous), ``SD`` is ``(R, C)`` (channels innermost);
* the ssm state is ``heads`` (its leading dim: Mamba2/GDN heads, Mamba1 channels) by
  ``ssm_head_bytes`` bytes, head-sharded;
* a sub-projection may be **replicated**: every rank holds it whole (Mamba2 with
  ``n_groups == 1`` holds group 0's B and C on every rank, vLLM's
  ``extra_groups_for_head_shards``); only Mamba2's B and C are, and only together.

:class:`GlobalStateGeometry` is the TP-independent description (global widths, the number of
groups / heads each sub-projection is sharded by) that the peers exchange
(:meth:`GlobalStateGeometry.to_wire`); :meth:`GlobalStateGeometry.at` derives one rank's
:class:`StateGeometry` for a TP size with vLLM's rule (a piece of ``g`` groups is sharded
when ``tp`` divides ``g``; Mamba2's B/C with one group is replicated; anything else is
refused naming ``tp`` and the piece).

:func:`state_ranges` implements the overlap rule: for every
sharded piece, destination rank ``d`` holds global units ``[d*wD, (d+1)*wD)``, source rank
``p`` holds ``[p*wP, (p+1)*wP)``; each intersection is copied (one byte range per piece in
``DS``, one per conv row per piece in ``SD``). A replicated piece is read whole from the
first source rank of ``d``. One formula covers ``tpD > tpP`` (``d`` reads a slice of one
source page) and ``tpP > tpD`` (``d`` gathers ``k`` source pages). Offsets are bytes from the
layer page's start; padding is never read or written.

This module is vLLM-free: the integration builds a :class:`StateGeometry` from each side's
``MambaSpec`` and layer, and the peers exchange it in the handshake.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .errors import HandshakeError, LayoutError

__all__ = ["GlobalStateGeometry", "StateGeometry", "state_ranges", "source_ranks",
           "STATE_KINDS", "CONV_LAYOUTS"]

#: state kinds modelled (vLLM's ``MambaSpec.mamba_type`` names) -> number of conv
#: sub-projections, in page order
STATE_KINDS: Mapping[str, int] = {"MAMBA1": 1, "MAMBA2": 3, "GDN_ATTN": 3}
#: ``DS`` = conv state ``(channels, rows)``; ``SD`` = ``(rows, channels)``
CONV_LAYOUTS = ("DS", "SD")

#: bounds: real models have a few thousand conv channels, a few hundred heads, TP <= 2**16
MAX_TP = 1 << 16
MAX_UNITS = 1 << 24
MAX_BYTES = 1 << 40

_WIRE_KEYS = ("kind", "conv_layout", "conv_rows", "conv_itemsize", "proj_widths",
              "proj_groups", "ssm_heads", "ssm_head_bytes")


def _int(name: str, v: Any, lo: int, hi: int, where: str = "StateGeometry") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise LayoutError(f"{where}: {name} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _common(g: Any, where: str) -> None:
    """Checks shared by the global and the per-rank geometry."""
    if not isinstance(g.kind, str) or g.kind not in STATE_KINDS:
        raise LayoutError(f"{where}: kind must be one of {list(STATE_KINDS)}, got "
                          f"{g.kind!r} (other state types are not modelled across TP)")
    if not isinstance(g.conv_layout, str) or g.conv_layout not in CONV_LAYOUTS:
        raise LayoutError(f"{where}: conv_layout must be one of {list(CONV_LAYOUTS)}, "
                          f"got {g.conv_layout!r}")
    _int("conv_rows", g.conv_rows, 1, 1 << 10, where)
    _int("conv_itemsize", g.conv_itemsize, 1, 16, where)
    _int("ssm_heads", g.ssm_heads, 1, MAX_UNITS, where)
    _int("ssm_head_bytes", g.ssm_head_bytes, 1, MAX_BYTES, where)
    widths = tuple(g.proj_widths) if isinstance(g.proj_widths, (list, tuple)) else None
    n = STATE_KINDS[g.kind]
    if widths is None or len(widths) != n:
        raise LayoutError(f"{where}: kind {g.kind} has {n} conv sub-projections, "
                          f"proj_widths is {g.proj_widths!r}")
    for j, w in enumerate(widths):
        _int(f"proj_widths[{j}]", w, 1, MAX_UNITS, where)
    object.__setattr__(g, "proj_widths", widths)
    # the kind's own invariants (vLLM's shape calculators and derive_mamba_conv_split)
    if g.kind == "GDN_ATTN" and widths[0] != widths[1]:
        raise LayoutError(f"{where}: GDN_ATTN needs Q and K equally wide (proj_widths[0] == "
                          f"proj_widths[1]), got {widths}")
    if g.kind == "MAMBA2" and widths[1] != widths[2]:
        raise LayoutError(f"{where}: MAMBA2 needs B and C equally wide (proj_widths[1] == "
                          f"proj_widths[2]), got {widths}")
    if g.kind == "MAMBA1" and g.ssm_heads != widths[0]:
        raise LayoutError(f"{where}: MAMBA1's ssm state has one row per conv channel: "
                          f"ssm_heads {g.ssm_heads} != proj_widths[0] {widths[0]}")


@dataclasses.dataclass(frozen=True)
class GlobalStateGeometry:
    """One Mamba state group's TP-independent geometry (what the peers exchange).

    ``proj_widths[j]`` is sub-projection ``j``'s GLOBAL channels; ``proj_groups[j]`` the
    number of units vLLM shards it by (Mamba2: x by heads, B/C by ``n_groups``; GDN: Q/K by
    k heads, V by v heads; Mamba1: x by channel); ``ssm_heads`` the global ssm leading dim.
    :meth:`at` gives one rank's :class:`StateGeometry`.
    """

    kind: str
    conv_layout: str
    conv_rows: int
    conv_itemsize: int
    proj_widths: tuple[int, ...]
    proj_groups: tuple[int, ...]
    ssm_heads: int
    ssm_head_bytes: int

    def __post_init__(self) -> None:
        where = "GlobalStateGeometry"
        _common(self, where)
        groups = tuple(self.proj_groups) if isinstance(self.proj_groups, (list, tuple)) else None
        n = STATE_KINDS[self.kind]
        if groups is None or len(groups) != n:
            raise LayoutError(f"{where}: proj_groups must hold {n} ints (one per "
                              f"sub-projection), got {self.proj_groups!r}")
        for j, (w, g) in enumerate(zip(self.proj_widths, groups)):
            _int(f"proj_groups[{j}]", g, 1, MAX_UNITS, where)
            if w % g:
                raise LayoutError(f"{where}: proj_widths[{j}] {w} is not a multiple of "
                                  f"proj_groups[{j}] {g}")
        object.__setattr__(self, "proj_groups", groups)
        pair = {"GDN_ATTN": (0, 1), "MAMBA2": (1, 2)}.get(self.kind)
        if pair and groups[pair[0]] != groups[pair[1]]:
            raise LayoutError(f"{where}: {self.kind} shards sub-projections {pair[0]} and "
                              f"{pair[1]} by the same groups, got proj_groups {groups}")

    def replicated(self, j: int) -> bool:
        """Sub-projection ``j`` is whole on every rank at any TP size (Mamba2 B/C of one
        group: vLLM's ``extra_groups_for_head_shards`` copies group 0 to every rank)."""
        return self.kind == "MAMBA2" and j in (1, 2) and self.proj_groups[j] == 1

    def at(self, tp: int) -> StateGeometry:
        """This group's per-rank geometry at TP size ``tp`` (LayoutError naming ``tp`` and
        the piece when ``tp`` does not divide it and it is not replicated)."""
        _int("tp", tp, 1, MAX_TP, "GlobalStateGeometry.at")
        widths, reps = [], []
        for j, (w, g) in enumerate(zip(self.proj_widths, self.proj_groups)):
            rep = self.replicated(j)
            if not rep and g % tp:
                raise LayoutError(f"GlobalStateGeometry.at: tp {tp} does not divide conv "
                                  f"sub-projection {j}'s {g} groups ({self.kind})")
            widths.append(w if rep else w // tp)
            reps.append(rep)
        if self.ssm_heads % tp:
            raise LayoutError(f"GlobalStateGeometry.at: tp {tp} does not divide the "
                              f"{self.ssm_heads} ssm heads ({self.kind})")
        return StateGeometry(self.kind, tp, self.conv_layout, self.conv_rows,
                             self.conv_itemsize, tuple(widths), tuple(reps),
                             self.ssm_heads // tp, self.ssm_head_bytes)

    def to_wire(self) -> dict[str, Any]:
        """A JSON/msgpack-safe dict for the handshake (inverse: :meth:`from_wire`)."""
        return {"kind": self.kind, "conv_layout": self.conv_layout,
                "conv_rows": self.conv_rows, "conv_itemsize": self.conv_itemsize,
                "proj_widths": list(self.proj_widths), "proj_groups": list(self.proj_groups),
                "ssm_heads": self.ssm_heads, "ssm_head_bytes": self.ssm_head_bytes}

    @classmethod
    def from_wire(cls, d: Any) -> GlobalStateGeometry:
        """Rebuild a peer's geometry; a malformed dict raises HandshakeError naming the key."""
        if not isinstance(d, Mapping):
            raise HandshakeError(f"state geometry must be a dict, got {type(d).__name__}")
        missing = [k for k in _WIRE_KEYS if k not in d]
        extra = sorted(str(k) for k in d if k not in _WIRE_KEYS)
        if missing or extra:
            raise HandshakeError(f"state geometry: missing keys {missing}, unknown keys {extra}")
        try:
            return cls(**{k: d[k] for k in _WIRE_KEYS})
        except LayoutError as e:
            raise HandshakeError(f"peer state geometry is malformed: {e}") from None


@dataclasses.dataclass(frozen=True)
class StateGeometry:
    """The per-rank geometry of one Mamba state group at TP size ``tp`` (every layer of the
    group is equal); usually built by :meth:`GlobalStateGeometry.at`.

    ``proj_widths[j]`` is sub-projection ``j``'s channels on ONE rank; ``proj_replicated[j]``
    says every rank holds it whole (else it is sharded: global width = ``width * tp``); only
    Mamba2's B and C may be, and only together. ``ssm_heads`` is the ssm state's leading dim
    on one rank (always sharded), ``ssm_head_bytes`` the bytes of one head
    (``prod(shape[1:]) * dtype size``). Validated on construction (LayoutError naming the
    field and rule).
    """

    kind: str
    tp: int
    conv_layout: str
    conv_rows: int
    conv_itemsize: int
    proj_widths: tuple[int, ...]
    proj_replicated: tuple[bool, ...]
    ssm_heads: int
    ssm_head_bytes: int

    def __post_init__(self) -> None:
        _common(self, "StateGeometry")
        _int("tp", self.tp, 1, MAX_TP)
        reps = tuple(self.proj_replicated) \
            if isinstance(self.proj_replicated, (list, tuple)) else None
        n = STATE_KINDS[self.kind]
        if reps is None or len(reps) != n:
            raise LayoutError(f"StateGeometry: proj_replicated must hold {n} bools (one per "
                              f"sub-projection), got {self.proj_replicated!r}")
        for j, r in enumerate(reps):
            if not isinstance(r, bool):
                raise LayoutError(f"StateGeometry: proj_replicated[{j}] must be a bool, got {r!r}")
        if any(reps) and not (self.kind == "MAMBA2" and reps == (False, True, True)):
            raise LayoutError(f"StateGeometry: only MAMBA2's B and C (together) can be "
                              f"replicated, got proj_replicated {reps} for {self.kind}")
        object.__setattr__(self, "proj_replicated", reps)
        if self.content_bytes > MAX_BYTES:
            raise LayoutError(f"StateGeometry: content of {self.content_bytes} B exceeds "
                              f"{MAX_BYTES} B")

    # -- derived sizes (per rank) --
    @property
    def conv_channels(self) -> int:
        return sum(self.proj_widths)

    @property
    def conv_bytes(self) -> int:
        return self.conv_channels * self.conv_rows * self.conv_itemsize

    @property
    def ssm_bytes(self) -> int:
        return self.ssm_heads * self.ssm_head_bytes

    @property
    def content_bytes(self) -> int:
        """Bytes of state per page on one rank; the rest of the page is padding."""
        return self.conv_bytes + self.ssm_bytes


def source_ranks(src_tp: int, dst_tp: int, dst_rank: int) -> range:
    """Source ranks destination rank ``dst_rank`` reads state from (sizes must divide):
    ``[d*tpS//tpD]`` when ``tpD >= tpS``, else the ``k = tpS/tpD`` ranks ``d*k .. d*k+k-1``.
    LayoutError naming the argument for a size or rank that is not an int in range."""
    _int("src_tp", src_tp, 1, MAX_TP, "source_ranks")
    _int("dst_tp", dst_tp, 1, MAX_TP, "source_ranks")
    if isinstance(dst_rank, bool) or not isinstance(dst_rank, int) or not 0 <= dst_rank < dst_tp:
        raise LayoutError(f"source_ranks: dst_rank must be an int in [0, {dst_tp}), "
                          f"got {dst_rank!r}")
    _check_tp(src_tp, dst_tp)
    if dst_tp >= src_tp:
        p = dst_rank * src_tp // dst_tp
        return range(p, p + 1)
    k = src_tp // dst_tp
    return range(dst_rank * k, dst_rank * k + k)


def _check_tp(src_tp: int, dst_tp: int) -> None:
    if max(src_tp, dst_tp) % min(src_tp, dst_tp):
        raise HandshakeError(f"state TP sizes {src_tp} (source) and {dst_tp} (destination): "
                             f"neither divides the other (vLLM requires it)")


def _check_pair(src: StateGeometry, dst: StateGeometry) -> None:
    for field, rule in (("kind", "the same state type"),
                        ("conv_layout", "the same conv state layout (a DS/SD mix needs a "
                                        "transposed copy, not a byte range)"),
                        ("conv_rows", "equal conv rows (conv kernel - 1 + speculative tokens)"),
                        ("conv_itemsize", "the same conv state dtype size"),
                        ("ssm_head_bytes", "equal ssm bytes per head (shape and dtype)")):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise HandshakeError(f"state geometry: {field} is {a!r} at the source, {b!r} at "
                                 f"the destination; peers need {rule}")
    _check_tp(src.tp, dst.tp)
    pieces = [(f"conv sub-projection {j}", ws, wd, rs, rd) for j, (ws, wd, rs, rd) in
              enumerate(zip(src.proj_widths, dst.proj_widths,
                            src.proj_replicated, dst.proj_replicated))]
    pieces.append(("ssm heads", src.ssm_heads, dst.ssm_heads, False, False))
    for name, ws, wd, rs, rd in pieces:
        if rs != rd:
            raise HandshakeError(f"state geometry: {name} is {'replicated' if rs else 'sharded'} "
                                 f"at the source, {'replicated' if rd else 'sharded'} at the "
                                 f"destination")
        if rs and ws != wd:
            raise HandshakeError(f"state geometry: replicated {name} is {ws} wide at the source, "
                                 f"{wd} at the destination; a replicated piece must be equal")
        if not rs and ws * src.tp != wd * dst.tp:
            raise HandshakeError(f"state geometry: {name} is {ws} per rank x tp {src.tp} at the "
                                 f"source but {wd} x tp {dst.tp} at the destination: the widths "
                                 f"neither shard one global width nor replicate")


def state_ranges(src: StateGeometry, src_rank: int, dst: StateGeometry,
                 dst_rank: int) -> list[tuple[int, int, int]]:
    """Byte ranges ``(src_offset, dst_offset, nbytes)`` that source rank ``src_rank`` gives
    destination rank ``dst_rank``, offsets from each side's layer page start.

    Empty when ``src_rank`` is not a source of ``dst_rank`` (:func:`source_ranks`). Sorted by
    destination offset, adjacent conv ranges merged, the ssm range never merged with a conv
    range (no range crosses ``conv_bytes`` on either side, so a layer registered as two
    state regions maps every range into one region). When the pair passes the checks below,
    the ranges of all source ranks cover the destination's ``content_bytes`` exactly once.
    Works in either direction (``src`` is the side read from: P for a pull, P for a push
    too). Refusals (HandshakeError naming the
    field): different kind, conv layout, rows, conv dtype size or ssm head bytes; a piece
    replicated on one side only, or whose widths neither shard nor replicate; TP sizes that
    do not divide.
    """
    if not isinstance(src, StateGeometry) or not isinstance(dst, StateGeometry):
        raise LayoutError(f"src and dst must be StateGeometry, got {type(src).__name__} and "
                          f"{type(dst).__name__}")
    _check_pair(src, dst)
    if isinstance(src_rank, bool) or not isinstance(src_rank, int) \
            or not 0 <= src_rank < src.tp:
        raise LayoutError(f"src_rank must be in [0, {src.tp}), got {src_rank!r}")
    if isinstance(dst_rank, bool) or not isinstance(dst_rank, int) \
            or not 0 <= dst_rank < dst.tp:
        raise LayoutError(f"dst_rank must be in [0, {dst.tp}), got {dst_rank!r}")
    sources = source_ranks(src.tp, dst.tp, dst_rank)
    if src_rank not in sources:
        return []
    first = src_rank == sources[0]
    R, dt = src.conv_rows, src.conv_itemsize
    out: list[tuple[int, int, int]] = []
    # conv: per sub-projection, the local channel ranges [ls, ls+n) -> [ld, ld+n)
    off_s = off_d = 0
    for ws, wd, rep in zip(src.proj_widths, dst.proj_widths, src.proj_replicated):
        span = _overlap(ws, src_rank, wd, dst_rank, rep, first)
        if span is not None:
            ls, ld, n = span
            if src.conv_layout == "DS":
                out.append(((off_s + ls) * R * dt, (off_d + ld) * R * dt, n * R * dt))
            else:  # SD: one range per conv row
                cs, cd = src.conv_channels, dst.conv_channels
                out.extend(((r * cs + off_s + ls) * dt, (r * cd + off_d + ld) * dt, n * dt)
                           for r in range(R))
        off_s += ws
        off_d += wd
    out = _merge(out)
    span = _overlap(src.ssm_heads, src_rank, dst.ssm_heads, dst_rank, False, first)
    if span is not None:
        ls, ld, n = span
        u = src.ssm_head_bytes
        out.append((src.conv_bytes + ls * u, dst.conv_bytes + ld * u, n * u))
    return out


def _overlap(ws: int, p: int, wd: int, d: int, replicated: bool,
             first: bool) -> tuple[int, int, int] | None:
    """(source local start, destination local start, units) of one piece, or None."""
    if replicated:
        return (0, 0, wd) if first else None
    a, b = max(p * ws, d * wd), min((p + 1) * ws, (d + 1) * wd)
    if a >= b:
        return None
    return a - p * ws, a - d * wd, b - a


def _merge(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for s, d, n in sorted(ranges, key=lambda t: (t[1], t[0])):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            ps, pd, pn = out[-1]
            out[-1] = (ps, pd, pn + n)
        else:
            out.append((s, d, n))
    return out
