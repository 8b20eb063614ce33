"""kvik's mixture-of-experts models against transformers on the same random weights (CPU, fp32):
teacher-forced log-probabilities at every position through prefill chunks, greedy generations
with prefix-cache hits and with preemption, both expert layouts of a checkpoint, and dummy
weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_engine_vs_transformers import GREEDY, assert_greedy_equal, make_llm
from tiny_models import load_hf, ragged_prompts
from tiny_moe_models import MOE_KINDS, build_tiny_moe, moe_config

from kvik import SamplingParams
from kvik.model_loader import load_model, load_model_config

ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """tiny_moe(kind, stacked=False) -> folder of a saved random-weight MoE model."""
    made: dict[tuple[str, bool], Path] = {}

    def make(kind: str, stacked: bool = False) -> Path:
        if (kind, stacked) not in made:
            folder = tmp_path_factory.mktemp(f"{kind}-{'stacked' if stacked else 'experts'}")
            made[kind, stacked] = build_tiny_moe(kind, folder, stacked=stacked)
        return made[kind, stacked]

    return make


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_logprobs_at_every_position(kind, tiny_moe):
    """Teacher-forced log-probabilities of every computed position within 1e-4 of transformers',
    through prefill chunks and decodes across block edges."""
    folder = tiny_moe(kind)
    llm = make_llm(folder, max_num_batched_tokens=24)
    engine = llm.engine
    prompts = ragged_prompts(4, seed=11, low=10, high=45)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [
        llm.input_processor.make_request(str(i), p, params, 0, 0.0) for i, p in enumerate(prompts)
    ]
    for request in requests:
        engine.add_request(request)
    got: dict[str, dict[int, torch.Tensor]] = {r.request_id: {} for r in requests}
    chunked = False
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        inputs = engine.runner.prepare_inputs(so)
        logits = engine.runner.model.compute_logits(engine.runner.forward_hidden(inputs)).float()
        row, sampled = 0, {}
        for s in so.scheduled:
            chunked |= not s.samples
            for j in range(s.num_tokens):
                got[s.request.request_id][s.start + j] = logits[row + j].log_softmax(-1)
            if s.samples:
                sampled[s.request.request_id] = [int(logits[row + s.num_tokens - 1].argmax())]
            row += s.num_tokens
        engine.scheduler.update_from_output(so, sampled)
    assert chunked, "no prefill was split into chunks"
    hf = load_hf(folder)
    for request in requests:
        tokens = request.all_token_ids
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        ours = torch.stack([got[request.request_id][p] for p in range(len(tokens) - 1)])
        err = (ours - expected[: len(tokens) - 1]).abs().max()
        assert err <= 1e-4, f"{kind}: logprob error {err:.2e}"


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_greedy_with_prefix_hits_equals_transformers(kind, tiny_moe):
    folder = tiny_moe(kind)
    prefix = ragged_prompts(1, seed=12, low=40, high=41)[0]
    prompts = [prefix + tail for tail in ragged_prompts(6, seed=13, low=3, high=30)]
    llm = make_llm(folder)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warms the cache with the shared prefix
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outputs)
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


def test_moe_greedy_with_preemption(tiny_moe):
    folder = tiny_moe("mixtral")
    prompts = ragged_prompts(4, seed=15, low=20, high=50)
    llm = make_llm(folder, num_kv_blocks=8, max_model_len=96)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_both_expert_layouts_load_the_same_model(kind, tiny_moe):
    per_expert, stacked = tiny_moe(kind), tiny_moe(kind, stacked=True)
    with safe_open(stacked / "model.safetensors", "pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())
    with safe_open(per_expert / "model.safetensors", "pt") as f:
        assert not any(k.endswith("experts.gate_up_proj") for k in f.keys())
    models = [
        load_model(load_model_config(str(folder), dtype="float32"), torch.device("cpu"))
        for folder in (per_expert, stacked)
    ]
    a, b = (dict(m.state_dict()) for m in models)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    hf = load_hf(per_expert).model.layers[0].mlp.experts
    ours = models[0].model.layers[0].mlp.experts
    assert torch.equal(ours.gate_up_proj, hf.gate_up_proj)
    assert torch.equal(ours.down_proj, hf.down_proj)


def test_missing_expert_is_a_clear_error(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_moe("qwen3_moe")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.0.mlp.experts.5.up_proj.weight"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors")
    config = load_model_config(str(tmp_path), dtype="float32")
    with pytest.raises(ValueError, match=r"experts.gate_up_proj of experts \[5\]"):
        load_model(config, torch.device("cpu"))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_dummy_weights_run_a_config_only_folder(kind, tmp_path):
    """``--load-format dummy`` on a folder with a config.json and nothing else, as the GPU
    benchmarks load bench/models/qwen3-30b-a3b."""
    config = moe_config(kind)
    config.architectures = [ARCHITECTURES[kind]]
    config.save_pretrained(tmp_path)
    llm = make_llm(tmp_path, load_format="dummy")
    prompts = ragged_prompts(3, seed=14)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [GREEDY.max_tokens] * 3
