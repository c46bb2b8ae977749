import pytest

from adapterserve.models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)
