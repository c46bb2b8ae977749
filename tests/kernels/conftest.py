"""Kernel tests: Triton runs under its CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before any ``@triton.jit`` runs, so it is set here,
before the test modules import the kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
