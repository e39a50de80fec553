#!/usr/bin/env bash
# The peer trainers `python -m bench.peers` runs, in their own virtualenv (never .venv):
# SpecForge 0.2.0 with the CPU torch the project pins and the transformers SpecForge pins.
#
#     bash bench/peers_install.sh [VENV]     # default: .peers-venv at the repository root
#
# SpecForge goes in with --no-deps: its requirements pull sglang, whose CUDA wheels only its
# hidden-state capture needs; the bench writes those files itself. What its offline DFlash training
# and its export import are installed beside it (pure Python, plus torch and transformers).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.peers-venv}"
PY="${PY:-python3}"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first and alone, the project's CPU pin (pyproject.toml's `cpu` extra), as the Makefile does
"$VENV/bin/pip" install -q "$("$PY" "$ROOT/tools/pins.py" extra cpu torch)"
"$VENV/bin/pip" install -q transformers==5.8.1 accelerate==1.16.0 numpy==2.4.6 pydantic==2.14.4 \
    PyYAML==6.0.4 safetensors==0.8.0 tqdm==4.70.1 psutil==7.2.2
"$VENV/bin/pip" install -q --no-deps specforge==0.2.0
"$VENV/bin/specforge" --help > /dev/null
echo "peers installed in $VENV"
