"""Shared test helpers: PEFT-made adapters, PEFT's reference deltas, bad adapters."""
from tests.helpers.bad_adapters import BAD_CASES, PICKLE_SENTINEL, make_bad_adapter
from tests.helpers.lora import (
    backbone_spec,
    load_base,
    load_peft,
    make_peft_lora,
    peft_deltas,
)

__all__ = [
    "BAD_CASES",
    "PICKLE_SENTINEL",
    "backbone_spec",
    "load_base",
    "load_peft",
    "make_bad_adapter",
    "make_peft_lora",
    "peft_deltas",
]
