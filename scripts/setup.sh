#!/usr/bin/env bash
# Creates .venv and installs adapterserve with its test and serving extras (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: the CPU build lies on local disk; an unpinned torch pulls CUDA.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,serve]"
