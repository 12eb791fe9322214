"""Smoke run of bench/bench_product.py at tiny sizes (8 requests x 4k tokens, a few steps).

Asserts every variant ran (D variants are n/a for prefill steps, by design) and produced
finite timings, and the benchmark's correctness preconditions: in every timed step each
variant scheduled the same requests with the same num_scheduled_tokens as the no-connector
scheduler, and every table an hmacore scheduler side follows mirrors vLLM's KV cache
manager view (bench_product.check_tables). No assertion on time (the machine is shared)."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_product as B  # noqa: E402
from product_report import render  # noqa: E402

STEPS = 3


def _check_cell(rec):
    assert rec["status"] == "ran", rec["status"]
    assert rec["timed_steps"] >= 1
    for v in B.VARIANTS:
        row = rec["variants"][v.name]
        if rec["kind"] not in v.kinds:
            assert row["status"].startswith("n/a"), (v.name, row)
            continue
        assert row["status"] == "ran", (rec["cell"], v.name, row["status"])
        assert row["steps"] == rec["timed_steps"]
        for k in ("median_ms", "p90_ms", "mean_ms", "wall_median_ms"):
            assert math.isfinite(row[k]) and row[k] > 0, (v.name, k, row[k])
        assert row["sched_mismatch_steps"] == 0, (rec["cell"], v.name)
        if v.name != "none":
            assert math.isfinite(row["overhead_ms"])
            # the connector's hooks were timed (every step runs build_connector_meta)
            assert 0 < row["hook_mean_ms"] < row["mean_ms"], (v.name, row["hook_mean_ms"])
        else:
            assert row["hook_mean_ms"] == 0.0
        if v.baseline:
            assert row["ratio_vs"] == v.baseline and row["ratio"] > 0
        if v.name == "hma_push_P":      # its scheduler follows no table: its worker does
            assert row["table_check"].startswith("n/a (P's worker"), row["table_check"]
        elif v.connector and v.connector.startswith("Hma"):
            assert row["table_check"] == "equal", (rec["cell"], v.name, row["table_check"])


@pytest.mark.parametrize("layout", B.LAYOUTS)
@pytest.mark.parametrize("kind", B.KINDS)
def test_every_variant_runs_with_equal_scheduling(layout, kind):
    rec = B.run_cell(B.Cell(layout, 8, 4096, kind), STEPS, log=lambda s: None)
    _check_cell(rec)


def test_worker_side_and_profile_and_report(tmp_path):
    cell = B.Cell("dsv4", 8, 4096, "decode")
    rec = B.run_cell(cell, STEPS, keep=True, log=lambda s: None)
    engines = rec.pop("_engines")
    try:
        prof = B.profile_hooks(engines, 2)
        assert set(prof) == {v.name for v in B.VARIANTS if (v.connector or "").startswith("Hma")}
        assert all("build_connector_meta" in t for t in prof.values())
        rec["worker"] = B.worker_bench(cell, engines, 2)
    finally:
        for e in engines:
            e.close()
    for name in B.WORKER_VARIANTS:
        w = rec["worker"][name]
        assert w["status"] == "ran", (name, w)
        assert math.isfinite(w["median_ms"]) and w["median_ms"] >= 0
    _check_cell(rec)
    skipped = B.run_cell(B.Cell("gptoss", 256, 131072, "decode"), STEPS, mem_gib=0.5)
    assert skipped["status"].startswith("skipped: estimated"), skipped
    doc = {"meta": {"steps": STEPS}, "cells": [rec, skipped]}
    jp, mp = B.write_outputs(doc, str(tmp_path), "product")
    assert json.load(open(jp))["cells"][0]["cell"] == cell.key
    md = open(mp).read()
    assert "| dsv4 | 8 | 4k | decode |" in md and "skipped: estimated" in md
    assert "## Targets on hook time" in md and "| hma_pull_D |" in md
    assert md == render(doc)


def test_cli_quick_writes_json_and_markdown(tmp_path, capsys):
    assert B.main(["--quick", "--layouts", "gptoss", "--kinds", "decode", "--steps", "2",
                   "--out", str(tmp_path)]) == 0
    doc = json.load(open(tmp_path / "product.json"))
    assert [c["cell"] for c in doc["cells"]] == ["gptoss/8x4k/decode"]
    _check_cell(doc["cells"][0])
    assert "## Scheduler step" in capsys.readouterr().out


def test_push_worker_plans_every_step_with_tables_equal_to_vllms():
    """Push P's worker bench: the worker joins the running engine, plans every push step of
    the metadata (its own tables fed by the PushSaves' new ids, pairs with D's registration),
    and after every step its tables equal vLLM's under the sparse rule; no push refused."""
    cell = B.Cell("gptoss", 8, 16384, "prefill")
    rec = B.run_cell(cell, STEPS, keep=True, variants=B.chosen_variants(["hma_push_P"]),
                     log=lambda s: None)
    engines = rec.pop("_engines")
    try:
        w = B.worker_bench(cell, engines, 8)["hma_push_P"]
    finally:
        for e in engines:
            e.close()
    assert w["status"] == "ran", w
    assert w["push_saves"] > 0 and w["table_check"] == "equal" and w["failed"] == 0, w


def test_hook_split_names_where_the_time_goes(capsys):
    import hook_split
    assert hook_split.main(["hma_push_P", "gptoss", "8", "4096", "prefill", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "build_connector_meta" in out and "ms/step" in out
    # the push plan; P's scheduler follows no table (design (b): its worker does), so no
    # TrackerSet call and no follow step is timed on the scheduler side
    assert "_push_plan" in out and "trackers." not in out and "_follow" not in out
