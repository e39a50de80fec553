#!/usr/bin/env bash
# The peer trainers `python -m bench.peers` runs, each in its own virtualenv (never .venv), beside
# the CPU torch the project pins:
#   .peers-venv              SpecForge, with the transformers it pins
#   .peers-venv-speculators  vLLM speculators
#
#     bash bench/peers_install.sh [specforge|speculators|all]     # default: all
#
# SpecForge goes in with --no-deps: its requirements pull sglang, whose CUDA wheels only its
# hidden-state capture needs; the bench writes those files itself. What its offline DFlash training
# and its export import are installed beside it (pure Python, plus torch and transformers).
# Every pin is read from pyproject.toml ([tool.dflash-ray] peers, peers-no-deps, peers-speculators).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3}"
WHICH="${1:-all}"
case "$WHICH" in
    all | specforge | speculators) ;;
    *) echo "usage: bash bench/peers_install.sh [specforge|speculators|all]" >&2; exit 2 ;;
esac

new_venv() {  # a virtualenv with the project's CPU torch alone, first, as the Makefile does
    "$PY" -m venv "$1"
    "$1/bin/pip" install -q --upgrade pip
    "$1/bin/pip" install -q "$("$PY" "$ROOT/tools/pins.py" extra cpu torch)"
}

if [[ "$WHICH" == all || "$WHICH" == specforge ]]; then
    VENV="$ROOT/.peers-venv"
    new_venv "$VENV"
    # shellcheck disable=SC2046
    "$VENV/bin/pip" install -q $("$PY" "$ROOT/tools/pins.py" tool peers)
    # shellcheck disable=SC2046
    "$VENV/bin/pip" install -q --no-deps $("$PY" "$ROOT/tools/pins.py" tool peers-no-deps)
    "$VENV/bin/specforge" --help > /dev/null
    echo "SpecForge installed in $VENV"
fi
if [[ "$WHICH" == all || "$WHICH" == speculators ]]; then
    VENV="$ROOT/.peers-venv-speculators"
    new_venv "$VENV"
    # shellcheck disable=SC2046
    "$VENV/bin/pip" install -q $("$PY" "$ROOT/tools/pins.py" tool peers-speculators)
    # CUDA builds its dependencies drag in, which break `import transformers` on a CPU; it uses neither
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio || true
    "$VENV/bin/python" -c "import speculators.train.cli"
    echo "speculators installed in $VENV"
fi
