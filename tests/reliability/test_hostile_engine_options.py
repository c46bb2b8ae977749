"""Hostile values of the engine options kv_cache_dtype (and `serve --kv-cache-dtype`), pdl,
decode_attention_dots and weight_prefetch:
refused before anything starts, naming the option; good values reach the engine's config."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from adapterserve.clients import cli
from adapterserve.server.app import build_app

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"
HOSTILE = ["int8", "FP8", "", None, 8, True, [], {"dtype": "fp8"}, math.nan]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_bad_kv_cache_dtype_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"kv_cache_dtype": value}})


@pytest.mark.parametrize("value", ["on", "late", *HOSTILE[2:]])
def test_a_bad_pdl_mode_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match="pdl must be one of"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"pdl": value}})


@pytest.mark.parametrize("value", ["tf32", "bf16", *HOSTILE[2:]])
def test_a_bad_attention_dots_choice_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match="decode_attention_dots must be one of"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"decode_attention_dots": value}})


@pytest.mark.parametrize("value", [-1, 17, 2.5, "4", *HOSTILE[:3], *HOSTILE[5:]])
def test_a_bad_weight_prefetch_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match="weight_prefetch must be an integer from 0 to 16"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"weight_prefetch": value}})


def test_the_flag_takes_only_its_choices():
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    args = cli._parser().parse_args(["serve", "--model", str(MODEL), "--no-encoder", "--kv-cache-dtype", "fp8"])
    assert cli.serve_config(args)["engine"]["kv_cache_dtype"] == "fp8"
