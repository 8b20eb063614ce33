"""kvik's engine against Hugging Face transformers on the same weights (CPU, eager, fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_hf, ragged_prompts

from kvik import LLM, SamplingParams

KINDS = ["llama", "mistral", "qwen2", "qwen3"]


def hf_greedy(
    model, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' generate() for one prompt alone: tokens and the logits each was chosen from."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids,
            # Explicit: otherwise transformers masks every token equal to the pad id (SmolLM2's
            # <|im_end|> is both), computing something else than the prompt.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0].float() for step in out.logits]


def assert_greedy_equal(prompts, kvik_outputs, hf_model, max_new_tokens: int) -> None:
    """Token-for-token equality; a divergence is accepted only as a genuine near-tie (the two best
    logprobs within 1e-3, kvik's token being one of them), in at most one prompt."""
    near_ties = 0
    for prompt, output in zip(prompts, kvik_outputs):
        expected, logits = hf_greedy(hf_model, prompt, max_new_tokens)
        got = output.outputs[0].token_ids
        assert len(got) == max_new_tokens
        if got == expected:
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        top = logits[i].log_softmax(-1).topk(2)
        gap = float(top.values[0] - top.values[1])
        assert gap < 1e-3 and got[i] in top.indices.tolist(), (
            f"prompt of {len(prompt)} tokens diverges at output {i}: kvik {got[i]}, "
            f"transformers {expected[i]}, logprob gap {gap:.2e}"
        )
        near_ties += 1
    assert near_ties <= 1


def make_llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(str(folder), dtype="float32", enforce_eager=True, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_every_position(kind, tiny_model):
    """Logits of every computed position, through prefill chunks and decodes across block edges."""
    folder = tiny_model(kind)
    llm = make_llm(folder, max_num_batched_tokens=24)
    engine = llm.engine
    prompts = ragged_prompts(5, seed=1, low=10, high=45)
    requests = [
        llm.input_processor.make_request(
            str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 0, 0.0
        )
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        engine.add_request(request)
    kvik_logits: dict[str, dict[int, torch.Tensor]] = {r.request_id: {} for r in requests}
    chunked = False
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        inputs = engine.runner.prepare_inputs(so)
        logits = engine.runner.model.compute_logits(engine.runner.forward_hidden(inputs)).float()
        row = 0
        sampled = {}
        for s in so.scheduled:
            chunked |= not s.samples
            for j in range(s.num_tokens):
                kvik_logits[s.request.request_id][s.start + j] = logits[row + j]
            if s.samples:
                sampled[s.request.request_id] = [int(logits[row + s.num_tokens - 1].argmax())]
            row += s.num_tokens
        engine.scheduler.update_from_output(so, sampled)
    assert chunked, "no prefill was split into chunks"
    hf = load_hf(folder)
    for request in requests:
        tokens = request.all_token_ids
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0].float()
        got = torch.stack([kvik_logits[request.request_id][p] for p in range(len(tokens) - 1)])
        err = (got - expected[: len(tokens) - 1]).abs().max() / expected.abs().max()
        assert err <= 1e-4, f"{kind}: relative logits error {err:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_batch_equals_transformers_alone(kind, tiny_model):
    folder = tiny_model(kind)
    prompts = ragged_prompts(8, seed=2)
    outputs = make_llm(folder).generate(prompts, GREEDY, use_tqdm=False)
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


def test_greedy_with_prefix_cache_hits(tiny_model):
    folder = tiny_model("llama")
    prefix = ragged_prompts(1, seed=3, low=40, high=41)[0]
    prompts = [prefix + tail for tail in ragged_prompts(8, seed=4, low=3, high=20)]
    llm = make_llm(folder)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warms the cache with the shared prefix
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.prefix_cache_hits > 0
    assert all(o.num_cached_tokens >= 32 for o in outputs)
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


def test_greedy_with_preemption(tiny_model):
    folder = tiny_model("qwen3")
    prompts = ragged_prompts(8, seed=5, low=20, high=60)
    llm = make_llm(folder, num_kv_blocks=12, max_model_len=96)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


def test_greedy_with_chunked_prefill(tiny_model):
    folder = tiny_model("mistral")
    prompts = ragged_prompts(8, seed=6, low=30, high=90)
    llm = make_llm(folder, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_prefill_chunks > 1
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


def test_seeded_sampling_independent_of_batch(tiny_model):
    llm = make_llm(tiny_model("llama"))
    prompts = ragged_prompts(4, seed=7)
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts, [seeded, others, others, others], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    again = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_top_k_one_equals_greedy(tiny_model):
    llm = make_llm(tiny_model("qwen2"))
    prompts = ragged_prompts(4, seed=8)
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    top1 = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_n_completions_share_the_prompt(tiny_model):
    llm = make_llm(tiny_model("llama"))
    prompt = ragged_prompts(1, seed=9, low=40, high=41)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_prefix_hit_on_blocks_computed_in_the_same_step(tiny_model):
    """A prompt of 33 tokens with n=2: the second completion hits the two blocks the first
    computes in the same step and computes one token, a decode row beside the first one's prompt
    chunk. On the CPU the decode rows used to attend before the chunk's keys were in the cache."""
    folder = tiny_model("llama")
    prompt = ragged_prompts(1, seed=10, low=33, high=34)[0]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(folder)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert llm.stats.prefix_cache_hits == 32
    assert_greedy_equal([prompt] * 2, [out, out], load_hf(folder), 8)
    assert out.outputs[1].token_ids == out.outputs[0].token_ids


def test_eos_stop_token_ids_and_min_tokens(tiny_model):
    folder = tiny_model("llama")
    llm = make_llm(folder)
    prompt = ragged_prompts(1, seed=10)[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    stopped = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == free[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    length = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert length[0].outputs[0].finish_reason == "length"
    # min_tokens forbids the stop token until 8 tokens exist
    held = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=8, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop_at not in held.token_ids[:8]
    assert len(held.token_ids) >= 8


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ([5] * 600, SamplingParams(), "max_model_len"),
        ([5, 300], SamplingParams(), "token ids"),
        ([5, -1], SamplingParams(), "token ids"),
    ],
)
def test_bad_prompts_raise(tiny_model, prompt, params, match):
    llm = make_llm(tiny_model("llama"))
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_folder_and_architecture(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="neither a local folder"):
        LLM(str(tmp_path / "missing"))
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}'
    )
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        LLM(str(folder))
