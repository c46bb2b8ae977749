"""Pinned adapters in the server config: checked at start, before any replica loads them."""
import pytest

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.errors import AdapterError
from adapterserve.server.replica import check_pinnable
from adapterserve.server.settings import merge_config, resolve_paths


def _version(info: dict | None) -> AdapterVersion:
    return AdapterVersion(name="sentiment", version=1, content_hash="abc", tenant=None, public=True, created_at=0.0,
                          size_bytes=1, files=(), info=info, file_sha256={})


def test_a_pinned_adapter_must_be_made_for_the_replicas_backbone():
    check_pinnable(_version({"backbone": "minilm"}), "minilm")
    check_pinnable(_version(None), "tiny-llama")  # records from before backbones were kept
    with pytest.raises(AdapterError, match="validated for backbone 'minilm'.*serves 'tiny-llama'"):
        check_pinnable(_version({"backbone": "minilm"}), "tiny-llama")


@pytest.mark.parametrize("refs", ["sentiment", [""], [3]])
def test_pinned_refs_must_be_a_list_of_names(refs, tmp_path):
    config = merge_config({"pinned_adapters": refs, "store": str(tmp_path), "encoder": False})
    with pytest.raises(ValueError, match="pinned_adapters must be a list of adapter refs"):
        resolve_paths(config)


def test_encoder_pins_need_an_encoder(tmp_path):
    config = merge_config({"encoder_pinned_adapters": ["sentiment"], "store": str(tmp_path), "encoder": False})
    with pytest.raises(ValueError, match="runs no encoder"):
        resolve_paths(config)
