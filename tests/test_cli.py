"""`hmacore plan` / `hmacore presets`: output, JSON figures, layout files, errors."""
import json

import pytest

from hmacore.cli import main
from hmacore.presets import get_preset, preset_names


@pytest.mark.parametrize("preset", preset_names())
def test_plan_prints_groups_and_plan_for_every_preset(capsys, preset):
    assert main(["plan", "--preset", preset, "--tokens", "32768"]) == 0
    out = capsys.readouterr().out
    layout = get_preset(preset)
    assert f"hash block: {layout.hash_block_size} tokens" in out
    assert f"scheduler block: {layout.scheduler_block_size} tokens" in out
    for spec in layout.groups:
        assert spec.name in out
    assert "transfer plan:" in out and "non-HMA:" in out


def test_plan_json_matches_the_layout(capsys):
    assert main(["plan", "--preset", "deepseek-v4", "--tokens", "32768", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layout = get_preset("deepseek-v4")
    assert doc["blocks_held"] == list(layout.blocks_for_tokens(32768, clipped=False))
    assert doc["blocks_moved"] == [128, 3, 3, 3, 17]
    assert doc["hash_block_size"] == 4 and doc["scheduler_block_size"] == 256
    assert doc["plan"]["hma"]["descriptors"] < doc["plan"]["non_hma"]["descriptors"]


def test_plan_reads_a_layout_file(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"groups": [
        {"kind": "full", "block_size": 32, "num_layers": 2, "page_bytes": 1024, "name": "fa"},
        {"kind": "mamba", "block_size": 32, "num_layers": 2, "page_bytes": 1024, "name": "ssm"}]}))
    assert main(["plan", "--layout", str(f), "--tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "fa" in out and "mamba/align" in out


def test_plan_errors_name_the_rule(tmp_path, capsys):
    assert main(["plan", "--preset", "nope"]) == 2
    assert "preset must be one of" in capsys.readouterr().err
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"groups": [{"kind": "cross_attention", "block_size": 16}]}))
    assert main(["plan", "--layout", str(f)]) == 2
    assert "cross-attention is not supported" in capsys.readouterr().err


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    assert capsys.readouterr().out.split() == preset_names()


# -- no traceback ever reaches a user: one `hmacore: error:` line, exit 2 (usage) / 1 (runtime)
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None, cwd=ROOT, timeout=120):
    env = dict(env or {})
    e = {k: v for k, v in os.environ.items() if k != "HMACORE_DEBUG"}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env.pop("PYTHONPATH")] if "PYTHONPATH" in env else []))
    e.update(env)
    return subprocess.run([sys.executable, "-m", "hmacore", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc, code, *needles):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hmacore: error: "), proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


USAGE_CASES = [
    (["plan", "--layout", "missing.toml"],
     ["layout file 'missing.toml': cannot read it (No such file or directory)"]),
    (["plan", "--preset", "gpt-oss-12b"], ["preset must be one of", "did you mean 'gpt-oss-120b'?"]),
    (["plan", "--tokens", "abc"], ["plan: argument --tokens: must be an int >= 0, got 'abc'"]),
    (["plan", "--tokens", "-5"], ["argument --tokens: must be an int >= 0, got -5"]),
    (["plan", "--tokens", "1.5"], ["argument --tokens: must be an int >= 0, got '1.5'"]),
    (["plan", "--bogus"], ["unrecognized arguments: --bogus"]),
    ([], ["a command is required: plan, presets or demo"]),
    (["demo", "--tokens", "0"], ["demo: argument --tokens: must be an int >= 1, got 0"]),
    (["demo", "--requests", "x"], ["argument --requests: must be an int >= 1, got 'x'"]),
    (["demo", "--page-bytes", "10"], ["--page-bytes: must be an int >= 16 (page_bytes), got 10"]),
    (["demo", "--preset", "nope"], ["preset must be one of"]),
    (["demo", "--layout", "missing.json"], ["layout file 'missing.json': cannot read it"]),
]


@pytest.mark.parametrize("args,needles", USAGE_CASES, ids=[" ".join(a) or "-" for a, _ in USAGE_CASES])
def test_usage_and_config_errors_are_one_line_exit_2(args, needles):
    assert_one_line_error(run_cli(*args), 2, *needles)


@pytest.mark.parametrize("name,text,needles", [
    ("syntax.toml", '[[groups]]\nkind = "full"\nblock_size = \n', ["TOML syntax error", "line 3"]),
    ("syntax.json", '{"groups": [', ["JSON syntax error"]),
    ("missing.toml", '[[groups]]\nkind = "full"\n', ["group 0: group is missing required key 'block_size'"]),
    ("nogroups.toml", 'num_blocks = 100\n', ["needs a 'groups' list"]),
    ("typo.toml", 'num_block = 100\n[[groups]]\nkind = "full"\nblock_size = 16\n',
     ["unknown layout keys: ['num_block' (did you mean 'num_blocks'?)]"]),
    ("rule.toml", '[[groups]]\nkind = "full"\nblock_size = -5\n',
     ["GroupSpec.block_size must be an int >= 1, got -5"]),
    ("bool.toml", '[[groups]]\nkind = "full"\nblock_size = 16\neagle = "false"\n',
     ["GroupSpec.eagle must be a bool (True or False), got 'false'"]),
])
def test_bad_layout_files_are_one_line_exit_2(tmp_path, name, text, needles):
    path = _write(tmp_path, name, text)
    line = assert_one_line_error(run_cli("plan", "--layout", path), 2, *needles)
    assert f"layout file {path!r}: " in line


def test_debug_shows_the_traceback(tmp_path):
    for proc in (run_cli("plan", "--layout", "missing.toml", "--debug"),
                 run_cli("--debug", "plan", "--layout", "missing.toml"),
                 run_cli("plan", "--layout", "missing.toml", env={"HMACORE_DEBUG": "1"})):
        assert proc.returncode != 0
        assert "Traceback" in proc.stderr and "ConfigFileError" in proc.stderr
    quiet = run_cli("plan", "--layout", "missing.toml", env={"HMACORE_DEBUG": "0"})
    assert_one_line_error(quiet, 2)


def test_unexpected_failures_are_one_line_exit_1(capsys, monkeypatch):
    import hmacore.cli as cli

    def boom(layout, num_tokens):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(cli, "_plan_figures", boom)
    monkeypatch.delenv("HMACORE_DEBUG", raising=False)
    assert main(["plan", "--tokens", "16"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("hmacore: error: unexpected ZeroDivisionError: a bug (rerun with --debug or "
                   "HMACORE_DEBUG=1 for the traceback)")
    with pytest.raises(ZeroDivisionError):
        main(["plan", "--tokens", "16", "--debug"])


def test_runtime_hmacore_errors_exit_1(capsys, monkeypatch):
    import hmacore.cli as cli
    from hmacore.errors import TransferError

    def fail(layout, num_tokens):
        raise TransferError("pull of req-0 failed\n  (group 1)", request_id="req-0")
    monkeypatch.setattr(cli, "_plan_figures", fail)
    monkeypatch.delenv("HMACORE_DEBUG", raising=False)
    assert main(["plan", "--tokens", "16"]) == 1
    assert capsys.readouterr().err == "hmacore: error: pull of req-0 failed (group 1)\n"


def test_main_returns_codes_in_process(capsys):
    assert main(["plan", "--tokens", "x"]) == 2
    assert "argument --tokens" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_demo_without_nixl_is_one_line_exit_1(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "nixl.py").write_text('raise ImportError("simulated: NIXL is not installed")\n')
    proc = run_cli("demo", "--requests", "1", "--tokens", "100", "--quiet",
                   env={"PYTHONPATH": str(fake)})
    assert_one_line_error(proc, 1, "the NIXL hand-off needs the nixl package, which cannot be "
                                   "imported (ImportError: simulated: NIXL is not installed)")


def test_demo_child_failure_prints_its_last_error_line(tmp_path):
    # nixl imports in this process; the prefill child crashes when its agent loads nixl._api
    fake = tmp_path / "fake" / "nixl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "_api.py").write_text(
        "import sys\n"
        "if sys.argv[0].endswith('prefill.py'):\n"
        "    raise RuntimeError('simulated crash in the prefill process')\n")
    env = {"PYTHONPATH": str(fake.parent)}
    proc = run_cli("demo", "--requests", "1", "--tokens", "100", "--quiet", env=env)
    assert_one_line_error(proc, 1, "prefill process exited (exit code 1): RuntimeError: "
                                   "simulated crash in the prefill process")
    dbg = run_cli("demo", "--requests", "1", "--tokens", "100", "--quiet", "--debug", env=env)
    assert dbg.returncode == 1
    assert "Traceback" in dbg.stderr and "simulated crash in the prefill process" in dbg.stderr


def test_last_error_line():
    from hmacore.demo import last_error_line
    tb = ("warming up\nTraceback (most recent call last):\n  File \"x\", line 1, in <module>\n"
          "    import nixl\nImportError: no nixl\n")
    assert last_error_line(tb) == "ImportError: no nixl"
    chained = tb + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        tb.replace("no nixl", "still none").replace("warming up\n", "")
    assert last_error_line(chained) == "ImportError: still none"
    assert last_error_line("just a message\n\n") == "just a message"
    assert last_error_line("") == ""
