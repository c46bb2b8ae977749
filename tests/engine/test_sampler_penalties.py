"""Logit bias and presence, frequency and repetition penalties in the batched sampler,
against an independent float32 reference applied to each request alone (transformers'
SequenceBiasLogitsProcessor and RepetitionPenaltyLogitsProcessor, and OpenAI's
definition of presence and frequency penalties written out below), and end to end
against transformers' generate with the matching logits processors."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from adapterserve import Engine, SamplingParams
from adapterserve.engine.penalties import PenaltyState, apply_penalties
from adapterserve.engine.request import Request, RequestStatus
from adapterserve.engine.sampler import sample
from tests.helpers.recording import record_logits

VOCAB = 200
on_gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[on_gpu, needs_cuda])]

MIXED = [  # one batch: different penalties per row, greedy and seeded, rows without any
    SamplingParams(temperature=0, repetition_penalty=1.3),
    SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=7, repetition_penalty=0.7, frequency_penalty=-0.5, logit_bias={3: 2.5}),
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0, logit_bias={5: 4.0, 6: -100, 199: 1.5}),
    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=11, presence_penalty=-2, repetition_penalty=2.0),
    SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1e-6),
    SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=1e6, logit_bias={0: -3}),
]


class PresenceFrequency(LogitsProcessor):
    """OpenAI: logit[j] -= count[j] * frequency + (count[j] > 0) * presence, count[j] = how
    often j is among the generated tokens (input_ids after the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for token, count in Counter(ids).items():
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def processors(params: SamplingParams, prompt_len: int) -> list[LogitsProcessor]:
    """The reference's processors for one request, in the order transformers' generate runs them."""
    chain: list[LogitsProcessor] = []
    if params.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        chain.append(PresenceFrequency(prompt_len, params.presence_penalty, params.frequency_penalty))
    return chain


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """One request's logits [V] after its bias and penalties, float32 on the CPU."""
    scores = logits.detach().float().cpu()[None].clone()
    ids = torch.tensor([prompt + outputs])
    for processor in processors(params, len(prompt)):
        scores = processor(ids, scores)
    return scores[0]


# the sampler over mixed batches, request by request against the reference


def _requests(params: list[SamplingParams], gen: torch.Generator) -> list[Request]:
    return [Request(prompt_ids=torch.randint(0, VOCAB, (int(torch.randint(1, 40, (), generator=gen)),),
                                             generator=gen).tolist(), sampling=p) for p in params]


def _generators(params: list[SamplingParams], device: str) -> list[torch.Generator | None]:
    return [None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed) for p in params]


def _changes_logits(request: Request) -> bool:
    p = request.sampling
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or (p.penalised and request.output_ids))


def _step(state: PenaltyState, requests: list[Request], generators, device: str, gen: torch.Generator) -> None:
    """One sampling step of `requests`, each checked against the reference alone."""
    params = [r.sampling for r in requests]
    raw = (torch.randn(len(requests), VOCAB, generator=gen) * 4).to(device)
    before = raw.clone()
    penalties = state.prepare(requests)
    penalised = raw if penalties is None else apply_penalties(raw, penalties)
    tokens = sample(raw, params, [g for g, _ in generators], torch.Generator(device=device).manual_seed(0), penalties)
    state.record(penalties, tokens)
    assert torch.equal(raw, before), "the sampler changed the logits in place"
    for row, (request, token) in enumerate(zip(requests, tokens.tolist())):
        want = reference(raw[row], request.sampling, request.prompt_ids, request.output_ids)
        if _changes_logits(request):
            assert not torch.equal(want, raw[row].cpu()), "the reference ignores this row's penalties"
        torch.testing.assert_close(penalised[row].cpu(), want, rtol=1e-6, atol=1e-5)
        twin = generators[row][1]
        if request.sampling.greedy:
            assert token == int(want.argmax())
        elif twin is not None:  # a seeded row draws what it would draw alone
            alone = sample(want[None].to(device), [request.sampling], [twin], torch.Generator(device=device))
            assert token == alone.item()
        request.output_ids.append(token)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batches_match_each_request_alone(device):
    gen = torch.Generator().manual_seed(1)
    state = PenaltyState(VOCAB, torch.device(device))
    requests = _requests(MIXED, gen)
    generators = list(zip(_generators(MIXED, device), _generators(MIXED, device)))
    for _ in range(12):
        _step(state, requests, generators, device, gen)


@pytest.mark.parametrize("device", DEVICES)
def test_requests_joining_and_leaving_reuse_and_grow_the_tables(device):
    """Batches change every step: new requests join (some with a row freed by a finished one),
    more penalised requests run than the tables first hold, and each still matches the reference."""
    gen = torch.Generator().manual_seed(2)
    state = PenaltyState(VOCAB, torch.device(device))
    waiting = _requests(MIXED * 4, gen)
    running: list[tuple[Request, tuple]] = []
    steps = 0
    while waiting or running:
        for _ in range(min(len(waiting), int(torch.randint(1, 6, (), generator=gen)))):
            request = waiting.pop(0)
            running.append((request, tuple(_generators([request.sampling] * 2, device))))
        _step(state, [r for r, _ in running], [g for _, g in running], device, gen)
        for request, _ in running:
            if len(request.output_ids) >= int(torch.randint(2, 9, (), generator=gen)):
                request.status = RequestStatus.FINISHED
        running = [(r, g) for r, g in running if not r.finished]
        steps += 1
    penalised = sum(p.penalised for p in MIXED * 4)
    biased = sum(bool(p.logit_bias) for p in MIXED * 4)
    assert 8 < state.penalties.capacity < penalised, "the penalty tables neither grew nor reused rows"
    assert state.bias.capacity < biased, "the bias tables reused no rows"
    assert steps > 10


def test_a_batch_without_bias_or_penalties_skips_them():
    state = PenaltyState(VOCAB, torch.device("cpu"))
    plain = _requests([SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(top_k=3)],
                      torch.Generator().manual_seed(3))
    assert state.prepare(plain) is None
    assert state.penalties.capacity == state.bias.capacity == 0


# end to end: the engine against transformers' generate with the matching processors

MAX_TOKENS = 10
E2E = [
    SamplingParams(repetition_penalty=1.4),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=1.2, repetition_penalty=1.2),
    SamplingParams(logit_bias={"7": 3.0, "11": -2.0}),
    SamplingParams(logit_bias={9: 1.0}, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.3),
]
E2E = [dataclasses.replace(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in E2E]
PLAIN = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=40, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def _hf_greedy(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    kwargs = {}
    if params.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in params.logit_bias}
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    custom = [p for p in processors(params, len(prompt)) if isinstance(p, PresenceFrequency)]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                      pad_token_id=0, logits_processor=LogitsProcessorList(custom), **kwargs)
    return out[0, len(prompt):].tolist()


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(torch.randint(2, 30, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _count_preemptions(engine) -> list[int]:
    count = [0]
    preempt = engine.scheduler._preempt

    def counting(request):
        count[0] += 1
        preempt(request)

    engine.scheduler._preempt = counting
    return count


ENGINES = {
    "roomy": {},
    "tight": {"block_size": 4, "num_kv_blocks": 36, "max_num_batched_tokens": 24},  # chunked prefill, preemption
}


@pytest.mark.parametrize("config", list(ENGINES))
def test_greedy_tokens_match_transformers_and_other_rows_keep_theirs(llama_dir, hf, config):
    prompts = _prompts(len(E2E) + 2, seed=4)
    expected = [_hf_greedy(hf, prompt, params) for prompt, params in zip(prompts, E2E)]
    unpenalised = [_hf_greedy(hf, prompt, PLAIN) for prompt in prompts[:len(E2E)]]
    assert all(a != b for a, b in zip(expected, unpenalised)), "a case's penalty changes nothing here"
    engine = Engine.from_pretrained(llama_dir, **ENGINES[config])
    seeded_alone = engine.generate([prompts[-1]], SEEDED)[0].token_ids
    preemptions = _count_preemptions(engine)
    outs = engine.generate(prompts, E2E + [PLAIN, SEEDED])
    assert [o.token_ids for o in outs[:len(E2E)]] == expected
    assert outs[-2].token_ids == _hf_greedy(hf, prompts[-2], PLAIN)
    assert outs[-1].token_ids == seeded_alone
    assert (preemptions[0] > 0) == (config == "tight")


# the whole device path (overlapped steps, CUDA graphs) against the reference on the logits it saw


@pytest.mark.parametrize("device", DEVICES)
def test_each_greedy_token_is_the_reference_argmax_of_the_logits_the_engine_saw(llama_dir, device):
    options = {"device": "cuda", "dtype": "bfloat16"} if device == "cuda" else {}
    engine = Engine.from_pretrained(llama_dir, **options)
    params = (E2E + [PLAIN]) * 3
    prompts = _prompts(len(params), seed=6)
    raw = record_logits(engine)  # the model's logits, before bias and penalties
    outs = engine.generate(prompts, params)
    if device == "cuda":
        assert engine.runner.graphs._graphs, "no decode step ran as a CUDA graph"
    for prompt, p, out in zip(prompts, params, outs):
        assert len(raw[out.request_id]) == MAX_TOKENS == len(out.token_ids)
        for k, (logits, token) in enumerate(zip(raw[out.request_id], out.token_ids)):
            assert token == int(reference(logits, p, prompt, out.token_ids[:k]).argmax())
