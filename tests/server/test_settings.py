"""Config defaults and overrides, and the Serve options they become (no Ray needed)."""
from __future__ import annotations

import pytest

from adapterserve.server.app import _replica_options
from adapterserve.server.settings import DEFAULTS, default_model, merge_config, replica_actor_options, resolve_paths


def test_overrides_merge_into_defaults_without_touching_them():
    config = merge_config({"engine": {"device": "cuda"}, "replica": {"num_replicas": 3}})
    assert config["engine"] == {**DEFAULTS["engine"], "device": "cuda"}
    assert config["replica"]["num_replicas"] == 3
    assert config["replica"]["max_queued_requests"] == DEFAULTS["replica"]["max_queued_requests"]
    assert DEFAULTS["engine"]["device"] == "cpu"


@pytest.mark.parametrize("overrides", [{"modle": "x"}, {"replica": {"max_ongoing": 3}}])
def test_unknown_keys_are_refused(overrides):
    with pytest.raises(ValueError, match="unknown config"):
        merge_config(overrides)


def test_gpu_engines_ask_ray_for_a_gpu():
    assert replica_actor_options(merge_config({"engine": {"device": "cuda:0"}})) == {"num_cpus": 1, "num_gpus": 1}
    assert replica_actor_options(merge_config())["num_gpus"] == 0
    given = {"num_cpus": 4, "num_gpus": 1, "memory": 1 << 30}
    assert replica_actor_options(merge_config({"replica": {"ray_actor_options": given}})) == given


def test_autoscaling_config_passes_through():
    autoscaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    opts = _replica_options(merge_config({"replica": {"autoscaling_config": autoscaling}}), "replica")
    assert opts["autoscaling_config"] == autoscaling and opts["num_replicas"] == "auto"
    fixed = _replica_options(merge_config({"replica": {"num_replicas": 2}}), "replica")
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


def test_default_model_is_written_once(tmp_path):
    first = default_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    config = resolve_paths(merge_config({"model": str(first), "store": str(tmp_path / "s")}))
    assert config["model_id"] == "tiny-llama"


def test_a_model_dir_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_paths(merge_config({"model": str(tmp_path)}))


def test_app_builder_is_a_serve_config_entry_point(tmp_path):
    from ray.serve import Application

    from adapterserve.models.tiny import write_tiny_checkpoint
    from adapterserve.server.app import app_builder

    model = write_tiny_checkpoint(tmp_path / "m", "llama")
    assert isinstance(app_builder({"model": str(model), "store": str(tmp_path / "store")}), Application)
    with pytest.raises(ValueError, match="max_loras"):
        app_builder({"model": str(model), "engine": {"max_loras": 0}})


def test_default_encoder_preloads_the_examples(tmp_path):
    config = resolve_paths(merge_config({"model": str(default_model(tmp_path)), "store": str(tmp_path / "s")}))
    assert config["encoder_id"] == "all-MiniLM-L6-v2"
    assert sorted(config["preload_adapters"]) == ["sentiment", "topic"]


def test_no_encoder_and_a_chosen_encoder_preload_nothing(tmp_path):
    model = str(default_model(tmp_path))
    off = resolve_paths(merge_config({"model": model, "encoder": False}))
    assert off["encoder"] is None and off["preload_adapters"] == {}
    from adapterserve.models.encoder_loader import default_encoder_dir

    chosen = resolve_paths(merge_config({"model": model, "encoder": str(default_encoder_dir())}))
    assert chosen["preload_adapters"] == {}
    with pytest.raises(ValueError, match="--encoder"):
        resolve_paths(merge_config({"model": model, "encoder": str(tmp_path)}))
