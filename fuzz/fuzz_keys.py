#!/usr/bin/env python3
"""Atheris harness: hmacore.keys (store keys) and hmacore.spec (layouts from dicts / files).

Each input picks one entry point:
* KeyBuilder with fuzzed field strings, ranks and lookup namespaces: valid iff the
  documented field rules hold; every key equals the documented layout
  ``[prefix@]model[namespace]@tp_rank:t@pcp p@dcp d@pp_rank:pp@group:g@hex`` and
  parse_key inverts it exactly; fold_presence vs a plain "all namespaces answered 1".
* parse_key of random and near-valid strings: HashInputError, or fields that rebuild the
  very same key.
* KVLayout.from_dict of mutated layout documents (hostile values, missing / unknown keys,
  kind spellings), and the same document through from_file as JSON and as TOML: the three
  agree (same layout or all refuse with LayoutError). A layout that loads round-trips
  through to_dict / from_dict and repr / eval, and feeds window_plan, TrackerSet,
  blocks_for_tokens, TransferPlan.from_layout and HitFinder without a bare exception.
* KVLayout.from_file of random bytes as .toml / .json, and of bad paths.
"""
import atexit
import json
import os
import re
import shutil
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import numpy as np
    from hmacore.hits import HitFinder
    from hmacore.keys import KeyBuilder, KeyParts, RankNamespace, parse_key
    from hmacore.plan import TransferPlan
    from hmacore.presets import get_preset
    from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode
    from hmacore.tables import TrackerSet
    from hmacore.windows import window_plan

from fuzzlib import (PRESETS, Draw, call, expect, instrument_harness, is_int,  # noqa: E402
                     layout)

TMP = tempfile.mkdtemp(prefix="hmacore-fuzz-keys-")
atexit.register(shutil.rmtree, TMP, True)
NAMES = ("m", "dsv4", "llama-3-70b", "a b", "ünï", "x" * 40, "1", "-")


def text(d: Draw, sep_chance: int = 6) -> str:
    """A field string: a plain name, or fuzzed text that sometimes holds '@' / ':'."""
    if d.int(0, 2):
        s = d.pick(NAMES)
    else:
        s = d.text(12)
    if d.chance(sep_chance):
        i = d.int(0, len(s))
        s = s[:i] + d.pick(("@", ":", "@x:y")) + s[i:]
    return s


def field_ok(s, allow_empty: bool) -> bool:
    return isinstance(s, str) and (allow_empty or s != "") and "@" not in s and ":" not in s


def namespace(d: Draw):
    """'' or '@name:value' segments (sometimes malformed); valid flag: the documented
    grammar, '' or one or more '@name:value' with no '@' / ':' inside a name or value."""
    if d.int(0, 2) == 0:
        return "", True
    ns = "".join(f"@{text(d, 8)}:{text(d, 8)}" for _ in range(d.int(1, 3)))
    if d.chance(10):
        ns = d.pick(("@a", "a:b", "@a:b@", "@:b", ns + ":"))
    return ns, re.fullmatch(r"(?:@[^@:]+:[^@:]+)+", ns) is not None


def rank(d: Draw):
    """(RankNamespace or None when its construction must fail, the call result)."""
    vals = [d.int(0, 7) if d.int(0, 9) else d.pick((-1, True, 2**70, 1.5, "1", np.int64(2)))
            for _ in range(4)]
    ok, r = call(RankNamespace, *vals)
    good = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals)
    expect(ok == good, lambda: f"RankNamespace{tuple(vals)} ok={ok}: {r}")
    return r if ok else None


def check_keys(d: Draw) -> None:
    model, prefix = text(d), text(d) if d.chance(3) else ""
    if d.chance(20):
        model = d.pick((None, 7, b"m", ""))
    ns, ns_ok = namespace(d)
    r = rank(d) or RankNamespace()
    lookup = None
    if d.chance(4):
        lookup = {d.int(0, 3) if d.int(0, 7) else d.pick((-1, "0", 2**31)):
                  d.pick(([r], [RankNamespace(1), r], [], [5], "r", r))
                  for _ in range(d.int(1, 2))}
    ok, kb = call(KeyBuilder, model, r, cache_prefix=prefix, store_namespace=ns,
                  lookup_namespaces=lookup)
    lookup_ok = lookup is None or all(
        is_int(g) and 0 <= g <= 2**31 - 1 and isinstance(v, list) and v and
        all(isinstance(x, RankNamespace) for x in v) for g, v in lookup.items())
    good = field_ok(model, False) and field_ok(prefix, True) and ns_ok and lookup_ok
    expect(ok == good, lambda: f"KeyBuilder({model!r}, prefix={prefix!r}, ns={ns!r}, "
           f"lookup={lookup!r}) ok={ok}: {kb}")
    if not ok:
        return
    g = d.int(0, 5) if d.int(0, 9) else d.pick((-1, 2**31 - 1, 2**31, True, "1", np.int64(3)))
    width = d.pick((16, 32, 48, 64)) if d.int(0, 9) else d.pick((0, 8, 17))
    n = d.int(0, 4)
    digests = np.frombuffer(d.bytes(n * width), np.uint8).reshape(n, width) if width else \
        np.zeros((n, 0), np.uint8)
    if d.chance(8):
        digests = d.pick((digests.astype(np.int16), digests.reshape(-1), digests.tolist()))
    ok, keys = call(kb.keys, g, digests)
    good_g = is_int(g) and 0 <= g <= 2**31 - 1
    good_d = isinstance(digests, np.ndarray) and digests.dtype == np.uint8 and \
        digests.ndim == 2 and width in (16, 32, 48, 64)
    expect(ok == (good_g and good_d), lambda: f"keys({g!r}, {digests!r}) ok={ok}: {keys}")
    if not ok:
        return
    lead = f"{prefix}@" if prefix else ""
    for k, row in zip(keys, digests):
        want = (f"{lead}{model}{ns}@tp_rank:{r.tp_rank}@pcp{r.pcp_rank}@dcp{r.dcp_rank}"
                f"@pp_rank:{r.pp_rank}@group:{int(g)}@" + bytes(row).hex())
        expect(k == want, lambda: f"key {k!r}, want {want!r}")
        ok2, parts = call(parse_key, k)
        expect(ok2 and parts == KeyParts(prefix, model, ns, r, int(g), bytes(row)),
               lambda: f"parse_key({k!r}) = {parts!r}")
    # fold_presence: 1 where every namespace of the row answered 1
    spaces = len(kb.namespaces(g))
    rows = d.int(0, 4) if d.int(0, 7) else d.pick((-1, True, 1.5))
    count = rows * spaces if is_int(rows) and rows >= 0 else 3
    vals = [d.pick((1, 1, 0, -1, 2)) for _ in range(count + (d.pick((-1, 1)) if d.chance(8) else 0))]
    results = d.pick((list, np.array, tuple))(vals) if not d.chance(8) else \
        d.pick(([1.0] * count, ["1"] * count, [[1], [1, 2]], None, np.ones(count, np.bool_)))
    ok, mask = call(kb.fold_presence, g, results, rows)
    arr = np.asarray(results, dtype=object) if isinstance(results, (list, tuple)) and \
        all(not isinstance(x, list) for x in results) else results
    good = is_int(rows) and rows >= 0 and isinstance(arr, np.ndarray) and arr.ndim <= 1 \
        and arr.size == rows * spaces and all(is_int(x) or isinstance(x, (bool, np.bool_))
                                              for x in np.ravel(arr))
    expect(ok == good, lambda: f"fold_presence({results!r}, {rows!r}) ok={ok}: {mask}")
    if ok and rows:
        want = [int(all(int(x) == 1 for x in np.ravel(arr)[i * spaces:(i + 1) * spaces]))
                for i in range(rows)]
        expect(mask.tolist() == want, lambda: f"fold_presence -> {mask}, want {want}")


def check_parse(d: Draw) -> None:
    if d.bool():
        key = d.text(200)
    else:           # a valid key, then one small edit
        kb = KeyBuilder(d.pick(NAMES), RankNamespace(d.int(0, 9), 0, d.int(0, 2), 0),
                        cache_prefix=d.pick(("", "dep", "ünï")),
                        store_namespace=d.pick(("", "@store_tp:2", "@a:b@c:d")))
        key = kb.keys(d.int(0, 9), np.frombuffer(d.bytes(16 * d.int(1, 2)), np.uint8).reshape(1, -1))[0]
        i = d.int(0, len(key))
        edit = d.pick(("", "@", ":", "0", "A", "del", "dup"))
        if edit == "del":
            key = key[:i] + key[i + 1:]
        elif edit == "dup":
            key = key[:i] + key[i:i + 3] + key[i:]
        else:
            key = key[:i] + edit + key[i:]
    ok, parts = call(parse_key, key)
    if ok:    # the exact inverse: its fields rebuild the very same key
        kb = KeyBuilder(parts.model, parts.rank, cache_prefix=parts.cache_prefix,
                        store_namespace=parts.store_namespace)
        d_arr = np.frombuffer(parts.digest, np.uint8).reshape(1, -1)
        expect(kb.keys(parts.group, d_arr) == [key], lambda: f"parse_key({key!r}) = {parts}")


# -- layout documents -----------------------------------------------------------------------
HOSTILE = (0, 1, -1, 2, 16, 64, 2**31, 2**63, 2**70, True, False, 1.5, 16.0, float("nan"),
           float("inf"), "16", "", "full", "align", None, [], [1], ["a", "a"], {}, {"a": 1})
KIND_NAMES = ("full", "FULL", "Full", "sliding_window", "chunked_local", "mamba",
              "cross_attention", "ful", "slidingwindow", 0, 1, 2, 3, 4, 5, True, 1.0, None)
FIELDS = GroupSpec.DOCUMENT_KEYS


def group_doc(d: Draw) -> dict:
    kind = d.pick(("full", "sliding_window", "chunked_local", "mamba")) if d.int(0, 7) else \
        d.pick(KIND_NAMES)
    g = {"kind": kind, "block_size": d.pick((1, 4, 16, 64, 544))}
    if kind in ("sliding_window", 1):
        g["sliding_window"] = d.int(1, 4096)
    if kind in ("chunked_local", 2):
        g["chunk_size"] = d.pick((64, 8192))
    if d.bool():
        g["num_layers"] = d.int(1, 4)
    for _ in range(d.int(0, 2)):
        key = d.pick(FIELDS)
        g[key] = d.pick(HOSTILE)
    if d.chance(6):
        g.pop(d.pick(("kind", "block_size")), None)
    if d.chance(8):
        g[d.pick(("blocksize", "kind ", "window", "x"))] = 1
    return g


def make_doc(d: Draw):
    if d.chance(3):
        lay = get_preset(d.pick(PRESETS)) if d.bool() else layout(d, huge=False)
        doc = lay.to_dict()
    else:
        doc = {"groups": [group_doc(d) for _ in range(d.int(0, 4))]}
        for key in ("num_blocks", "context_parallel", "prefix_match_unit"):
            if d.chance(3):
                doc[key] = d.pick(HOSTILE) if d.chance(3) else d.pick((2, 64, 1, 4, 16))
    for _ in range(d.int(0, 2)):       # mutate a value anywhere
        target = doc
        if doc.get("groups") and isinstance(doc["groups"], list) and d.bool():
            target = d.pick(doc["groups"])
            if not isinstance(target, dict):
                continue
        if target:
            target[d.pick(sorted(target, key=str))] = d.pick(HOSTILE)
    for g in doc.get("groups") or () if isinstance(doc.get("groups"), list) else ():
        n = g.get("num_layers") if isinstance(g, dict) else None
        if isinstance(n, int) and n > 1000:
            # gated: num_layers = 2**31 builds 2**31 layer names (spec.py: no upper bound;
            # reported in docs/reliability.md, not fixed on this branch)
            g["num_layers"] = 1001
    if d.chance(10):
        doc = d.pick((doc, [doc], "groups", None, {"groups": "full"}, {"groups": [1]}))
    return doc


class Unrepresentable(Exception):
    pass


def toml_str(s: str) -> str:
    out = []
    for c in s:
        out.append(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F or c in '"\\' else c)
    return '"' + "".join(out) + '"'


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise Unrepresentable(repr(v))     # None has no TOML form


def toml_key(k) -> str:
    if not isinstance(k, str):
        raise Unrepresentable(repr(k))
    return toml_str(k)


def write(name: str, data: bytes) -> str:
    path = os.path.join(TMP, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def outcome(fn, *args):
    """(True, layout) or (False, error class)."""
    ok, got = call(fn, *args)
    return (True, got) if ok else (False, type(got))


def check_doc(d: Draw) -> None:
    doc = make_doc(d)
    via_dict = outcome(KVLayout.from_dict, doc)
    forms = []
    try:
        forms.append(("json", json.dumps(doc, ensure_ascii=d.bool())))
    except (TypeError, ValueError):
        pass
    if isinstance(doc, dict):
        try:
            forms.append(("toml", "\n".join(f"{toml_key(k)} = {toml_value(v)}"
                                            for k, v in doc.items())))
        except Unrepresentable:
            pass
    for ext, src in forms:
        got = outcome(KVLayout.from_file, write("doc." + ext, src.encode()))
        expect(got[0] == via_dict[0] and (not got[0] or got[1] == via_dict[1]),
               lambda: f"from_file(.{ext}) {got} but from_dict {via_dict} for {src!r}")
    if via_dict[0]:
        check_loaded(d, via_dict[1])


def check_loaded(d: Draw, lay: KVLayout) -> None:
    """A loaded layout: round trips, and the consumers answer or refuse clearly."""
    doc = lay.to_dict()
    json.dumps(doc)
    expect(KVLayout.from_dict(doc) == lay, "to_dict / from_dict round trip")
    ns = {"KVLayout": KVLayout, "GroupSpec": GroupSpec, "GroupKind": GroupKind,
          "MambaMode": MambaMode}
    expect(eval(repr(lay), ns) == lay, lambda: f"repr not eval-able: {lay!r}")
    expect(lay.fingerprint() == KVLayout.from_dict(doc).fingerprint(), "fingerprint")
    call(lay.blocks_for_tokens, d.int(0, 10**6) if d.int(0, 5) else d.pick((-1, 2**70, 1.5)))
    call(window_plan, lay, exact=d.bool())
    call(TrackerSet, lay)
    if sum(len(s.layer_names) for s in lay.groups) <= 64:
        call(TransferPlan.from_layout, lay, d.int(2, 64), page_bytes=None if d.bool() else 64)
    if all(v < 2**62 for s in lay.groups for v in (s.block_size, s.sliding_window or 0,
                                                    s.chunk_size or 0)) \
            and lay.context_parallel < 2**31:
        # gated: a block size / window past int64 makes HitFinder raise a bare OverflowError
        # (hits.py, reported in docs/reliability.md, not fixed on this branch)
        call(HitFinder, lay)


def check_file(d: Draw) -> None:
    k = d.int(0, 9)
    if k == 0:
        path = d.pick((os.path.join(TMP, "missing.toml"), TMP, 7, None, b"/nonexistent.json",
                       os.path.join(TMP, "dir.toml/")))
        ok, got = call(KVLayout.from_file, path)
        expect(not ok, "a bad path loaded")
        return
    raw = d.bytes(d.int(0, 512)) if k < 4 else d.text(400).encode()
    if nesting(raw) > 100 or b"num_layers" in raw:
        # gated: JSON/TOML nested ~1000 deep raises a bare RecursionError, a huge
        # num_layers never returns (spec.py, reported in docs/reliability.md, not fixed here)
        return
    name = d.pick(("x.toml", "x.json", "x.TOML", "x.cfg"))
    ok, got = call(KVLayout.from_file, write(name, raw))
    if ok:
        check_loaded(d, got)


def nesting(b: bytes) -> int:
    depth = top = 0
    for c in b:
        if c in b"[{":
            depth += 1
            top = max(top, depth)
        elif c in b"]}":
            depth -= 1
    return top


def TestOneInput(data: bytes) -> None:
    d = Draw(data)
    [check_keys, check_keys, check_parse, check_doc, check_doc, check_doc,
     check_file][d.int(0, 6)](d)


if __name__ == "__main__":
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
