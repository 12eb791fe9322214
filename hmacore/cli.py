"""Command line: ``hmacore plan`` (layout and transfer plan) and ``hmacore demo`` (the main job)."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import HmacoreError
from .presets import DEFAULT_PRESET, get_preset, preset_names
from .spec import GroupKind, KVLayout


def load_layout(preset: str | None, layout_file: str | None) -> KVLayout:
    """A user layout file (JSON/TOML) wins over a preset name."""
    if layout_file:
        return KVLayout.from_file(layout_file)
    return get_preset(preset or DEFAULT_PRESET)


def format_layout(layout: KVLayout, num_tokens: int) -> str:
    """Human-readable table of groups, grains and per-group blocks for one request."""
    held = layout.blocks_for_tokens(num_tokens, clipped=False)
    moved = layout.blocks_for_tokens(num_tokens, clipped=True)
    rows = [("group", "name", "kind", "block", "window", "layers", "clip", "clip(exact)",
             f"blocks@{num_tokens}", "moved")]
    for g, s in enumerate(layout.groups):
        kind = s.kind.name.lower() + ("/mla" if s.mla else "")
        if s.kind == GroupKind.MAMBA:
            kind += f"/{s.mamba_mode.value}"
        window = s.sliding_window if s.sliding_window else (s.chunk_size or "-")
        clip = s.window_blocks() or ("state" if s.kind == GroupKind.MAMBA else "-")
        exact = s.window_blocks(exact=True) or ("state" if s.kind == GroupKind.MAMBA else "-")
        rows.append((str(g), s.name or "-", kind, str(s.block_size), str(window),
                     str(len(s.layer_names)), str(clip), str(exact), str(held[g]), str(moved[g])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"groups: {layout.num_groups}   hash block: {layout.hash_block_size} tokens   "
            f"scheduler block: {layout.scheduler_block_size} tokens   "
            f"hybrid: {'yes' if layout.is_hybrid else 'no'}   fingerprint: {layout.fingerprint()[:12]}")
    return head + "\n" + "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    layout = load_layout(args.preset, args.layout)
    if args.json:
        doc = {"layout": layout.to_dict(), "tokens": args.tokens,
               "blocks_held": layout.blocks_for_tokens(args.tokens, clipped=False),
               "blocks_moved": layout.blocks_for_tokens(args.tokens, clipped=True),
               "hash_block_size": layout.hash_block_size,
               "scheduler_block_size": layout.scheduler_block_size}
        extra = _plan_figures(layout, args.tokens)
        if extra is not None:
            doc["plan"] = extra[1]
        print(json.dumps(doc, indent=2))
        return 0
    name = args.layout or args.preset or DEFAULT_PRESET
    print(f"layout: {name}   request: {args.tokens} tokens\n")
    print(format_layout(layout, args.tokens))
    extra = _plan_figures(layout, args.tokens)
    if extra is not None:
        print()
        print(extra[0])
    return 0


def _plan_figures(layout: KVLayout, num_tokens: int):
    """(text, dict) of the transfer plan a connector would register (virtual addresses)."""
    from .plan import describe_layout_plan
    return describe_layout_plan(layout, num_tokens)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hmacore", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    pl = sub.add_parser("plan", help="print a layout and its transfer plan for one request")
    pl.add_argument("--preset", default=None, help=f"one of {preset_names()} (default {DEFAULT_PRESET})")
    pl.add_argument("--layout", default=None, help="a JSON/TOML layout file (overrides --preset)")
    pl.add_argument("--tokens", type=int, default=32768, help="request length in tokens")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_plan)
    ls = sub.add_parser("presets", help="list the preset layouts")
    ls.set_defaults(func=lambda a: print("\n".join(preset_names())) or 0)
    try:
        from .demo import add_demo_arguments
    except ImportError:
        add_demo_arguments = None
    if add_demo_arguments is not None:
        dm = sub.add_parser("demo", help="P/D hand-off of a hybrid model over real NIXL")
        add_demo_arguments(dm)
        dm.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except HmacoreError as e:
        print(f"hmacore: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # `hmacore plan | head`: the reader left; not an error
        sys.stderr.close()
        return 0
