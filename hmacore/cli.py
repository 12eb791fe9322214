"""Command line: ``hmacore plan`` (layout and transfer plan) and ``hmacore demo`` (the main job).

Errors never reach the user as a traceback: every failure prints one ``hmacore: error: ...``
line on stderr and exits with 2 (usage or configuration: bad arguments, a layout file that is
missing, malformed or breaks a rule, an unknown preset) or 1 (runtime: a transfer, a peer
process, a missing dependency, anything unexpected). ``--debug`` (or ``HMACORE_DEBUG=1``)
re-raises with the traceback instead, and lets the demo's prefill process print its own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import cast

from .errors import (ArgumentOverflowError, ArgumentTypeError, ArgumentValueError, ConfigError,
                     HmacoreError)
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


EXIT_RUNTIME = 1   # a transfer, a peer process, a dependency, an unexpected failure
EXIT_USAGE = 2     # bad arguments or configuration (layout file, preset, option values)
_USAGE_ERRORS = (ConfigError, ArgumentValueError, ArgumentTypeError, ArgumentOverflowError)
_DEBUG_ENV = "HMACORE_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``hmacore: error: plan: argument --tokens: ...``."""

    def error(self, message: str):  # type: ignore[override]
        where = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        sys.stderr.write(f"hmacore: error: {where}{message} (see '{self.prog} --help')\n")
        raise SystemExit(EXIT_USAGE)


def int_at_least(minimum: int, what: str = ""):
    """argparse ``type=``: a decimal int >= ``minimum`` (``"8.5"``, ``"1e3"``, ``"-1"`` refused).
    ``what`` names the quantity in the message."""
    rule = f"must be an int >= {minimum}" + (f" ({what})" if what else "")

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{rule}, got {value}")
        return value
    parse.__name__ = f"int >= {minimum}"
    return parse


def debug_requested(args: argparse.Namespace | None = None) -> bool:
    """``--debug`` given, or ``HMACORE_DEBUG`` is exactly one of 1/true/yes/on (any case)."""
    if args is not None and getattr(args, "debug", False):
        return True
    return os.environ.get(_DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=f"show tracebacks instead of one-line errors (or {_DEBUG_ENV}=1)")
    p = _Parser(prog="hmacore", description=__doc__.split("\n\n")[0], parents=[common])
    # typeshed ties the sub-parsers' class (and their `parents`) to _Parser; `common` is a plain
    # ArgumentParser (parents only lend their arguments)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               p.add_subparsers(dest="cmd", metavar="{plan,presets,demo}"))
    pl = sub.add_parser("plan", parents=[common],
                        help="print a layout and its transfer plan for one request")
    pl.add_argument("--preset", default=None, help=f"one of {preset_names()} (default {DEFAULT_PRESET})")
    pl.add_argument("--layout", default=None, help="a JSON/TOML layout file (overrides --preset)")
    pl.add_argument("--tokens", type=int_at_least(0), default=32768, help="request length in tokens")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_plan)
    ls = sub.add_parser("presets", parents=[common], help="list the preset layouts")
    ls.set_defaults(func=lambda a: print("\n".join(preset_names())) or 0)
    add_demo_arguments: Callable[[argparse.ArgumentParser], None] | None
    try:
        from .demo import add_demo_arguments
    except ImportError:
        add_demo_arguments = None
    if add_demo_arguments is not None:
        dm = sub.add_parser("demo", parents=[common],
                            help="P/D hand-off of a hybrid model over real NIXL")
        add_demo_arguments(dm)
        dm.set_defaults(func=cmd_demo)
    return p


def _one_line(e: BaseException) -> str:
    """The message on one line (newlines and indentation collapsed); the type if empty."""
    return " ".join(str(e).split()) or type(e).__name__


def report_error(e: BaseException) -> int:
    """Print ``e`` as one ``hmacore: error:`` line; return the exit code it maps to."""
    if isinstance(e, _USAGE_ERRORS):
        code, text = EXIT_USAGE, _one_line(e)
    elif isinstance(e, HmacoreError):
        code, text = EXIT_RUNTIME, _one_line(e)
    elif isinstance(e, ImportError):
        code, text = EXIT_RUNTIME, f"a module this command needs cannot be imported: {_one_line(e)}"
    else:
        code, text = EXIT_RUNTIME, (f"unexpected {type(e).__name__}: {_one_line(e)} (rerun with "
                                    f"--debug or {_DEBUG_ENV}=1 for the traceback)")
    print(f"hmacore: error: {text}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 1 runtime error, 2 usage/config)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (already printed as one line)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        try:
            parser.error("a command is required: plan, presets or demo")
        except SystemExit as e:
            return int(cast(int, e.code))   # _Parser.error exits with EXIT_USAGE
    debug = debug_requested(args)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:   # `hmacore plan | head`: the reader left; not an error
        try:  # Python flushes stdout at exit: point it at /dev/null so that cannot fail
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        print("hmacore: error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place every failure becomes one line
        if debug:
            raise
        return report_error(e)
