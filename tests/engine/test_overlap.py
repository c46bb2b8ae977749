"""Overlapped steps: step n+1 is launched before step n's tokens reach the host."""
import torch

from adapterserve import Engine, SamplingParams


def _prompts(n: int) -> list[list[int]]:
    return [torch.randint(3, 500, (int(torch.randint(2, 20, ())),)).tolist() for _ in range(n)]


def _count_rows(engine) -> dict[str, int]:
    """Request id -> rows it was given, over every launched step."""
    rows: dict[str, int] = {}
    run = engine.runner.run

    def counting(batch, generators):
        for request in batch.requests:
            rows[request.request_id] = rows.get(request.request_id, 0) + 1
        return run(batch, generators)

    engine.runner.run = counting
    return rows


def test_tokens_arrive_one_step_later_and_feed_the_next_step(llama_dir):
    engine = Engine.from_pretrained(llama_dir)
    prompt = _prompts(1)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].token_ids
    request = engine.add_request(prompt, params)
    assert engine.step() == []  # launched; nothing known on the host yet
    assert request.pending == 1 and request.output_ids == []
    chunks = engine.step()  # launches the second token, then hands out the first
    assert [c.token_ids for c in chunks] == [expected[:1]]
    assert request.pending == 1 and request.num_tokens == len(prompt) + 2
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == expected and request.pending == 0


def test_length_limit_is_known_at_launch_so_no_row_is_wasted(llama_dir):
    engine = Engine.from_pretrained(llama_dir)
    rows = _count_rows(engine)
    limits = [1, 3, 7]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in limits]
    outs = engine.generate(_prompts(3), params)
    assert [rows[o.request_id] for o in outs] == limits
    assert [len(o.token_ids) for o in outs] == limits


def test_stop_token_costs_at_most_one_discarded_row(llama_dir):
    engine = Engine.from_pretrained(llama_dir)
    prompt = _prompts(1)[0]
    free = engine.blocks.num_free
    probe = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    stop_at = probe[2]  # the third token ends the request
    rows = _count_rows(engine)
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,))
    out, other = engine.generate([prompt, _prompts(1)[0]], [params, SamplingParams(max_tokens=8, temperature=0.0)])
    first_stop = probe.index(stop_at) + 1
    assert out.token_ids == probe[:first_stop] and out.finish_reason == "stop"
    assert rows[out.request_id] in (first_stop, first_stop + 1)
    assert engine.blocks.num_free == free and sum(engine.slots.refs) == 0


def test_abort_while_a_step_is_in_flight_frees_blocks_and_ignores_its_token(llama_dir):
    engine = Engine.from_pretrained(llama_dir)
    free = engine.blocks.num_free
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    doomed, kept = (engine.add_request(p, params) for p in _prompts(2))
    engine.step()
    engine.step()
    assert doomed.pending == 1
    assert engine.abort(doomed.request_id)
    assert not doomed.blocks
    outputs = engine.step()  # resolves the step that still held `doomed`
    assert [o.request_id for o in outputs] == [kept.request_id]
    while engine.has_unfinished():
        engine.step()
    assert len(doomed.output_ids) == 1 and kept.finish_reason == "length"
    assert engine.blocks.num_free == free
