"""The layering rule: the core imports numpy only; only integrations/vllm imports vLLM."""
import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "hmacore"
FORBIDDEN_IN_CORE = {"torch", "nixl", "mooncake", "vllm"}


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """Modules imported at module level (not inside functions: lazy imports are allowed)."""
    if path.suffix == ".pyx":  # Cython is not Python syntax: read unindented import lines
        pat = re.compile(r"^(?:from\s+(\w+)\S*\s+c?import\b|c?import\s+(\w+))")
        return {m.group(1) or m.group(2) for line in path.read_text().splitlines()
                if (m := pat.match(line))}
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                # class bodies run at import time; methods do not
                if isinstance(n, ast.ClassDef):
                    stack.extend(b for b in n.body
                                 if not isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)))
                continue
            if isinstance(n, ast.Import):
                names.update(a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names.add(n.module.split(".")[0])
            stack.extend(ast.iter_child_nodes(n))
    return names


def _sources():
    return [p for p in PKG.rglob("*") if p.suffix in (".py", ".pyx")]


def test_vllm_imported_only_in_integrations():
    offenders = [str(p.relative_to(ROOT)) for p in _sources()
                 if "vllm" in _top_level_imports(p) and "integrations" not in p.parts]
    assert offenders == []


def test_core_imports_no_transport_or_torch_at_module_level():
    offenders = []
    for p in _sources():
        rel = p.relative_to(PKG)
        if rel.parts[0] in ("transport", "integrations"):
            continue
        bad = _top_level_imports(p) & FORBIDDEN_IN_CORE
        if bad:
            offenders.append((str(rel), sorted(bad)))
    assert offenders == []


def test_core_imports_with_numpy_alone():
    """Import every core module in a fresh interpreter where torch/nixl/mooncake/vllm cannot load."""
    core = sorted("hmacore." + ".".join(p.relative_to(PKG).with_suffix("").parts)
                  for p in PKG.glob("*.py") if p.stem not in ("__main__",))
    code = (
        "import sys, importlib\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(FORBIDDEN_IN_CORE)!r}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {core!r}:\n"
        "    importlib.import_module(m.replace('.__init__', ''))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
