#!/usr/bin/env bash
# The peer trainers `python -m bench.peers` runs, in their own virtualenv (never .venv):
# SpecForge with the CPU torch the project pins and the transformers SpecForge pins.
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
# the pins of [tool.dflash-ray] peers and peers-no-deps in pyproject.toml, the one place pins live
# shellcheck disable=SC2046
"$VENV/bin/pip" install -q $("$PY" "$ROOT/tools/pins.py" tool peers)
# shellcheck disable=SC2046
"$VENV/bin/pip" install -q --no-deps $("$PY" "$ROOT/tools/pins.py" tool peers-no-deps)
"$VENV/bin/specforge" --help > /dev/null
echo "peers installed in $VENV"
