#!/usr/bin/env bash
# Sets up the environment and runs the test suite (no GPU, no network but the registries).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -p no:cacheprovider "$@"
