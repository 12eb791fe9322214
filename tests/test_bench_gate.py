"""The benchmark report and ratio gate other projects run in their CI."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gate  # noqa: E402
import report  # noqa: E402


def _bench(group, impl, median, **extra):
    return {"group": group, "name": f"test_x[{impl}]", "params": {}, "stats": {"median": median},
            "extra_info": {"impl": impl, **extra}}


def test_report_pairs_cases_and_prefers_vllm_baseline():
    raw = {"benchmarks": [
        _bench("hit/dsv4/4k", "hmacore", 1e-5),
        _bench("hit/dsv4/4k", "oracle", 4e-4),
        _bench("hit/dsv4/4k", "vllm", 8e-4, bytes_per_key=40),
        _bench("clip/2g/4k", "hmacore", 2e-6),
        _bench("clip/2g/4k", "oracle", 1e-5),
        _bench("lonely", "oracle", 1.0),          # no hmacore side: not a case
    ]}
    rep = report.build_report(raw)
    cases = {c["name"]: c for c in rep["cases"]}
    assert set(cases) == {"hit/dsv4/4k", "clip/2g/4k"}
    hit = cases["hit/dsv4/4k"]
    assert hit["baseline"] == "vllm-0.32.0"
    assert abs(hit["ratio"] - 80.0) < 1e-9 and abs(hit["oracle_ratio"] - 40.0) < 1e-9
    assert hit["bytes_per_key"] == 40
    assert cases["clip/2g/4k"]["baseline"] == "oracle"
    assert abs(cases["clip/2g/4k"]["ratio"] - 5.0) < 1e-9


def test_gate_fails_only_below_fraction_of_baseline():
    results = {"cases": [{"name": "a", "ratio": 10.0}, {"name": "b", "ratio": 2.0}]}
    baseline = {"ratios": {"a": 12.0, "b": 5.0, "c": 3.0}}
    failures, lines = gate.gate(baseline, results, fraction=0.5, require_all=False)
    assert [f.split()[1] for f in failures] == ["b"]          # 2.0 < 0.5 * 5.0
    assert any(line.startswith("MISSING c") for line in lines)
    failures, _ = gate.gate(baseline, results, fraction=0.5)  # a case that did not run fails
    assert len(failures) == 2
    failures, _ = gate.gate(baseline, results, fraction=0.5, select="^[ab]$")
    assert len(failures) == 1


def test_stated_targets_are_the_floors():
    results = {"cases": [{"name": "hit-x-32k", "ratio": 9.0}, {"name": "hit-y-4k", "ratio": 9.0}]}
    baseline = {"ratios": {"hit-x-32k": 20.0, "hit-y-4k": 20.0}, "targets": {"hit-*-32k": 10}}
    failures, lines = gate.gate(baseline, results, fraction=0.25)
    # 9 >= 0.25 * 20 passes the regression floor, but the 32k case has a stated target of 10
    assert [f.split()[1] for f in failures] == ["hit-x-32k"]
    assert "target 10" in failures[0]


def test_gate_cli_exit_codes(tmp_path):
    (tmp_path / "base.json").write_text(json.dumps({"ratios": {"a": 4.0}}))
    (tmp_path / "ok.json").write_text(json.dumps({"cases": [{"name": "a", "ratio": 3.0}]}))
    (tmp_path / "bad.json").write_text(json.dumps({"cases": [{"name": "a", "ratio": 1.0}]}))
    run = lambda res: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / "bench" / "gate.py"), "--baseline", str(tmp_path / "base.json"),
         "--results", str(tmp_path / res), "--fraction", "0.5"], capture_output=True, text=True)
    assert run("ok.json").returncode == 0
    bad = run("bad.json")
    assert bad.returncode == 1 and "FAIL" in bad.stdout


def test_plot_places_every_recorded_case(tmp_path):
    """bench/plot.py draws every case of the recorded run (none skipped by its name) and
    refuses a name it cannot place."""
    import plot
    rep = json.loads((ROOT / "bench" / "results" / "latest.json").read_text())
    placed = [plot.parse(c["name"]) for c in rep["cases"]]
    assert len(placed) == len(rep["cases"]) > 50
    assert plot.parse("clip-2groups-128k-lists") == ("clip", "2groups-lists", 131072,
                                                     "request tokens")
    assert plot.parse("sched_step-dsv4-256req") == ("sched_step", "dsv4", 256, "requests")
    assert plot.parse("keys-4k") == ("keys", "keys", 4096, "request tokens")
    import pytest
    with pytest.raises(ValueError, match="no size part"):
        plot.parse("mystery-case")
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert plot.main([str(tmp_path / "r.json"), "-o", str(tmp_path)]) == 0
    assert (tmp_path / "bench_ratios.png").stat().st_size > 10000
