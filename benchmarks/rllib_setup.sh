#!/usr/bin/env bash
# A separate environment for the RLlib peer benchmark (benchmarks/rllib_sleep.py).
# RLlib is a benchmark peer only, never a trustrl dependency. CPU torch goes in first:
# asked for later, by ray[rllib]'s resolver, pip would fetch a multi-gigabyte CUDA build.
# Usage: bash benchmarks/rllib_setup.sh [VENV_DIR]   (default /tmp/rllib-venv)
set -euo pipefail
venv="${1:-/tmp/rllib-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0
pip install 'ray[rllib]==2.60.0' 'gymnasium>=1.0,<2'
"$venv/bin/python" -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"
