#!/usr/bin/env bash
# Create / update the vLLM 0.33.0 test venv (lean recipe, CPU torch), separate from .venv:
#   1. requirements/test.txt; --no-deps requirements/nixl.txt;
#   2. requirements/vllm-lean.txt (torch 2.13.0+cpu: a local version pip finds through its
#      find-links, /opt/wheels on this project's machines, or PyTorch's CPU index);
#   3. --no-deps requirements/vllm-033.txt (xgrammar 0.2.8, vllm 0.33.0: never its torch pin);
#   4. verify: vllm 0.33.0, torch 2.13.0+cpu, no nvidia-* / torchvision / torchaudio /
#      torchcodec, NIXL and vLLM's v1 Scheduler import with VLLM_TARGET_DEVICE=cpu.
# Usage: scripts/install_vllm033.sh VENV      (idempotent; exits non-zero on any failure)
set -euo pipefail

VENV="${1:?usage: $0 VENV}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
installed="$("$PY" -c 'import importlib.metadata as m
try: print(m.version("vllm"))
except m.PackageNotFoundError: print("")')"
if [ "$installed" != "0.33.0" ]; then
  echo "install_vllm033: installing the lean recipe + vllm 0.33.0 into $VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r "$HERE/requirements/test.txt"
  "$PY" -m pip install -q --no-deps -r "$HERE/requirements/nixl.txt"
  "$PY" -m pip install -q -r "$HERE/requirements/vllm-lean.txt"
  "$PY" -m pip install -q --no-deps -r "$HERE/requirements/vllm-033.txt"
else
  echo "install_vllm033: vllm 0.33.0 already installed in $VENV"
fi

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
"$PY" - <<'PYEOF'
import importlib.metadata as md
import importlib.util

import torch
assert torch.__version__ == "2.13.0+cpu", f"torch is {torch.__version__}, want 2.13.0+cpu"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} is installed; it must not be"
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower()
    assert not name.startswith("nvidia-"), f"CUDA package {name} got installed"
assert md.version("vllm") == "0.33.0", md.version("vllm")
import nixl  # noqa: F401
import vllm
import vllm.v1.core.sched.scheduler  # noqa: F401
print(f"install_vllm033: OK vllm={vllm.__version__} torch={torch.__version__}")
PYEOF
