"""n > 1 on a GPU (float32, CUDA graphs for the decodes): the block copies on the device, and
each choice equal to a request of its own with the choice's seed."""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("gpu-n"), "llama", num_layers=4, hidden_size=512,
                                      intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                                      vocab_size=2048, seed=3)
    return Engine.from_pretrained(model_dir, device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
                                  warmup=False)


def _sampled(**fields) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 24, "temperature": 1.0, "ignore_eos": True, "seed": 5} | fields))


@pytest.mark.parametrize("length", [37, 32])  # the prompt's last block partial, full
def test_choices_on_the_gpu_equal_requests_with_their_seeds(engine, length):
    prompt = torch.randint(3, 2000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    alone = [engine.generate([prompt], _sampled(seed=5 + i))[0].token_ids for i in range(4)]
    outs = engine.generate([prompt, prompt[:9]], [_sampled(n=4), _sampled(seed=99)])  # beside another request
    assert [o.token_ids for o in outs[:4]] == alone and len({tuple(a) for a in alone}) == 4
    assert engine.blocks.num_free == engine.blocks.num_blocks  # idle cached blocks count as free
