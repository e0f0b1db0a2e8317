#!/usr/bin/env bash
# Build circuit-tracer 0.5.0's own environment, apart from jstd's (it pins transformers <= 4.57.3):
#   .venv-ct/            torch 2.13.0 (CPU), transformers 4.57.3, circuit-tracer 0.5.0 (+ transformer-lens 3.x)
#   .venv-ct/nnsight061/ nnsight 0.6.1 and astor 0.8.1 *unpacked, not installed* (circuit-tracer's own repository
#                        pins nnsight 0.6.1; the 0.8.x that pip resolves cannot run its nnsight backend), plus two
#                        stubs: IPython (nnsight imports it at top level) and socketio (only nnsight's remote backend
#                        uses it). scripts/circuit_tracer/*.py put this folder first on sys.path themselves.
# Usage: bash scripts/circuit_tracer/setup.sh   (or `make circuit-tracer`); idempotent; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_CT:-.venv-ct}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ ! -f "$VENV/.installed" ]; then
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q transformers==4.57.3 circuit-tracer==0.5.0 pyyaml safetensors tokenizers
  touch "$VENV/.installed"
fi
NN="$VENV/nnsight061"
if [ ! -f "$NN/.unpacked" ]; then
  rm -rf "$NN"; mkdir -p "$NN/wheels"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$NN/wheels" nnsight==0.6.1 astor==0.8.1
  for w in "$NN"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$NN"; done
  mkdir -p "$NN/IPython" "$NN/socketio"
  cat > "$NN/IPython/__init__.py" <<'PYEOF'
"""Stub: nnsight imports IPython at top level only to detect a notebook."""


def get_ipython():
    return None
PYEOF
  cat > "$NN/socketio/__init__.py" <<'PYEOF'
"""Stub: only nnsight's remote (NDIF) backend uses socketio; circuit-tracer runs it locally."""


class SimpleClient:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("socketio stub: nnsight's remote backend is not available offline")


class Client(SimpleClient):
    pass
PYEOF
  touch "$NN/.unpacked"
fi
PYTHONPATH="$NN" "$PY" - <<'PYEOF'
import circuit_tracer, nnsight, transformers, torch, transformer_lens  # noqa: F401
from importlib.metadata import version
print("circuit-tracer env ok:", "torch", torch.__version__, "transformers", transformers.__version__,
      "circuit-tracer", version("circuit-tracer"), "transformer-lens", version("transformer-lens"),
      "nnsight", nnsight.__version__, "from", nnsight.__file__)
PYEOF
