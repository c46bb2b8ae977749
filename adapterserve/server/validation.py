"""Checking an upload against the served backbones before the store keeps it: the shared
check of adapters_store/fit.py (the CLI runs the same one before sending)."""
from __future__ import annotations

from adapterserve.adapters_store.fit import (
    adapter_validator,
    backbone_facts,
    backbone_spec,
    describe_adapter,
)

__all__ = ["adapter_validator", "backbone_facts", "backbone_spec", "describe_adapter"]
