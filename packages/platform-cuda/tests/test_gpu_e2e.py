"""kvik end to end on a CUDA GPU against Hugging Face transformers; skipped without CUDA.

Small random-weight Llama (llama3 rope scaling) and Qwen3 models are built here with transformers
(large initialisation, seeded, saved as safetensors), then run in kvik with ``device="cuda"``:
greedy tokens equal transformers' in fp32 (the near-tie rule of tests/test_engine_vs_transformers.py)
and stay within transformers' top-5 in bf16, through prefix-cache hits, chunked prefill and
preemption. The Triton path is proven by the selected platform and backend and by a profiler trace
of one step; sampling and a step's host work run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

# The CPU end-to-end helpers live in the repository's top-level tests/ (not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_engine_vs_transformers import assert_greedy_equal, hf_greedy  # noqa: E402
from tiny_models import load_hf, ragged_prompts  # noqa: E402

from kvik import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KINDS = ["llama", "qwen3"]
DTYPES = ["float32", "bfloat16"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# kvik's Triton kernels (@triton.jit names) that every step of these models launches.
# (Rotary and the cache write are one launch inside the attention backend.)
STEP_KERNELS = [
    "paged_attention_kernel",
    "rms_norm_kernel",
    "rotary_and_cache_kernel",
    "silu_and_mul_kernel",
]


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3Config

    # Head size 64 (a size the Triton attention is tuned for), GQA, large initialisation so that
    # next-token distributions are peaked and greedy ties are rare.
    common = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        return LlamaConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    return Qwen3Config(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def build_model_on_gpu(
    kind: str, folder: Path, seed: int = 0, device: str = "cuda", initializer_range: float = 0.1
) -> Path:
    """A random-weight model initialised on the GPU by transformers, saved as safetensors."""
    from transformers import AutoModelForCausalLM

    config = _config(kind)
    config.initializer_range = initializer_range
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    assert (folder / "model.safetensors").is_file()
    del model
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_model_on_gpu(kind, tmp_path_factory.mktemp(f"gpu-{kind}"))
        return made[kind]

    return make


@pytest.fixture(scope="module")
def hf_models(models):
    """transformers' reference: fp32 on the CPU (exact), bf16 on the GPU (kvik's precision)."""
    from transformers import AutoModelForCausalLM

    made: dict[tuple[str, str], object] = {}

    def get(kind: str, dtype: str):
        if (kind, dtype) not in made:
            if dtype == "float32":
                made[kind, dtype] = load_hf(models(kind))
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    models(kind), dtype=torch.bfloat16, attn_implementation="eager"
                ).to("cuda")
                model.generation_config.eos_token_id = None
                made[kind, dtype] = model.eval()
        return made[kind, dtype]

    return get


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def make_llm(folder: Path, dtype: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("max_model_len", 512)
    llm = LLM(str(folder), device="cuda", dtype=dtype, **kwargs)
    assert llm.engine.platform.name == "cuda"
    assert llm.engine.runner.backend.name == "TRITON_ATTN"
    assert llm.engine.runner.device.type == "cuda"
    return llm


def assert_greedy_in_top5(prompts, kvik_outputs, hf_model, max_new_tokens: int) -> None:
    """bf16: where kvik's tokens leave transformers', kvik's token is in transformers' top-5 at
    the first differing position."""
    diverged = []
    for prompt, output in zip(prompts, kvik_outputs):
        expected, logits = hf_greedy(hf_model, prompt, max_new_tokens)
        got = output.outputs[0].token_ids
        assert len(got) == max_new_tokens
        if got == expected:
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        top5 = logits[i].topk(5).indices.tolist()
        assert got[i] in top5, (
            f"prompt of {len(prompt)} tokens diverges at output {i}: kvik {got[i]}, "
            f"transformers {expected[i]}, transformers' top-5 {top5}"
        )
        diverged.append(i)
    print(
        f"bf16: {len(prompts) - len(diverged)}/{len(prompts)} prompts equal, divergences at {diverged}"
    )


def check_greedy(prompts, outputs, hf_model, dtype: str) -> None:
    if dtype == "float32":
        assert_greedy_equal(prompts, outputs, hf_model, MAX_TOKENS)
    else:
        assert_greedy_in_top5(prompts, outputs, hf_model, MAX_TOKENS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_prefix_cache_hits(kind, dtype, models, hf_models):
    prefix = ragged_prompts(1, seed=3, low=40, high=41)[0]
    prompts = [prefix + tail for tail in ragged_prompts(8, seed=4, low=3, high=20)]
    prompts += ragged_prompts(2, seed=12)  # and two that share nothing
    llm = make_llm(models(kind), dtype)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warms the cache with the shared prefix
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.prefix_cache_hits > 0
    assert all(o.num_cached_tokens >= 32 for o in outputs[:8])
    check_greedy(prompts, outputs, hf_models(kind, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_chunked_prefill(kind, dtype, models, hf_models):
    prompts = ragged_prompts(8, seed=6, low=30, high=90)
    llm = make_llm(models(kind), dtype, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_prefill_chunks > 0
    check_greedy(prompts, outputs, hf_models(kind, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_preemption(kind, dtype, models, hf_models):
    prompts = ragged_prompts(8, seed=5, low=20, high=60)
    llm = make_llm(models(kind), dtype, num_kv_blocks=12, max_model_len=96)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    check_greedy(prompts, outputs, hf_models(kind, dtype), dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_decodes_apart_from_prompt_chunks(kind, models, hf_models, monkeypatch):
    """Mixed steps of many decodes beside prompt chunks attend to the decodes in a launch of their
    own (``MIN_DECODES_APART``); greedy outputs stay transformers'. 48 prompts of 20-40 tokens
    under a 96-token budget keep ~25 requests decoding while the next prompts prefill."""
    from kvik.triton_kernels.attention import MIN_DECODES_APART, TritonAttentionImpl

    apart = []
    attend_apart = TritonAttentionImpl._attend_decodes_apart

    def counted(self, *args):
        apart.append(args[2].decodes_apart)  # (query, kv_cache, metadata, output, ...)
        return attend_apart(self, *args)

    monkeypatch.setattr(TritonAttentionImpl, "_attend_decodes_apart", counted)
    prompts = ragged_prompts(48, seed=8, low=20, high=40)
    llm = make_llm(models(kind), "float32", max_num_batched_tokens=96)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert apart and max(apart) >= MIN_DECODES_APART, apart
    check_greedy(prompts, outputs, hf_models(kind, "float32"), "float32")


def _add(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams):
    request = llm.input_processor.make_request(request_id, prompt, params, 0, 0.0)
    llm.engine.add_request(request)
    return request


def test_profiler_shows_kvik_triton_kernels(models):
    """One mixed step (decodes and a prefill) under torch.profiler launches kvik's kernels."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(models("qwen3"), "bfloat16")
    engine = llm.engine
    prompts = ragged_prompts(4, seed=11, low=20, high=60)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _add(llm, "a", prompts[0], params)
    _add(llm, "b", prompts[1], params)
    engine.step()  # prefills
    _add(llm, "c", prompts[2], params)
    engine.step()  # decodes and a prefill: compiles what the profiled step launches
    _add(llm, "d", prompts[3], params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    kernels = sorted(n for n in names if n.endswith("_kernel"))
    print("kernels in the profiled step:", kernels)
    missing = [k for k in STEP_KERNELS if not any(k in n for n in names)]
    assert not missing, f"not in the profiler trace: {missing}; it has {sorted(names)}"


@contextlib.contextmanager
def no_host_sync():
    """Any operation that waits for the GPU raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


SAMPLING_MIX = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.2, top_k=50, top_p=0.95, min_p=0.05, seed=7),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.7, seed=123),
]


def test_sampler_without_host_sync(models):
    llm = make_llm(models("llama"), "bfloat16")
    runner = llm.engine.runner
    requests = [
        llm.input_processor.make_request(f"s{i}", [5, 6, 7], p, 0, 0.0)
        for i, p in enumerate(SAMPLING_MIX)
    ]
    vocab = llm.config.model.vocab_size
    g = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(len(requests), vocab, device="cuda", generator=g) * 4
    batch = runner._sampling_batch(requests)
    with no_host_sync():
        sampled = runner.sampler(logits.clone(), batch)
        greedy_only = runner.sampler(logits[:1].clone(), runner._sampling_batch(requests[:1]))
        mixed_again = runner._sampling_batch(requests)  # pinned, non-blocking input copies
        runner.sampler(logits.clone(), mixed_again)
    tokens = sampled.tolist()
    argmax = logits.argmax(-1).tolist()
    probs = logits.softmax(-1)
    assert tokens[0] == argmax[0] and greedy_only.tolist() == argmax[:1]
    assert tokens[1] in (logits[1] / 0.8).topk(20).indices.tolist()
    assert tokens[3] in (probs[3] >= 0.2 * probs[3].max()).nonzero().flatten().tolist()
    assert tokens[4] in logits[4].topk(50).indices.tolist()
    assert tokens[5] == argmax[5]
    # A seeded request's token does not depend on the rest of its batch.
    again = [
        llm.input_processor.make_request(f"t{i}", [5, 6, 7], SAMPLING_MIX[i], 0, 0.0)
        for i in (6, 4, 2)
    ]
    rows = logits[[6, 4, 2]].clone()
    with no_host_sync():
        resampled = runner.sampler(rows, runner._sampling_batch(again))
    resampled = resampled.tolist()
    assert resampled[0] == tokens[6] and resampled[1] == tokens[4]


def test_step_host_work_without_sync(models):
    """A mixed step's inputs, forward, logits and sampling queue without waiting for the GPU; only
    reading the sampled tokens back waits."""
    llm = make_llm(models("llama"), "bfloat16")
    engine, runner = llm.engine, llm.engine.runner
    prompts = ragged_prompts(len(SAMPLING_MIX) + 2, seed=13, low=20, high=60)
    for i, params in enumerate(SAMPLING_MIX):
        _add(llm, str(i), prompts[i], replace(params, max_tokens=8, ignore_eos=True))
    engine.step()
    _add(llm, "late", prompts[-1], GREEDY)
    engine.step()  # a mixed step, compiling what the checked one launches
    _add(llm, "later", prompts[-2], GREEDY)  # a prompt of its own: no prefix hit
    scheduler_output = engine.scheduler.schedule()
    query_lens = sorted(s.num_tokens for s in scheduler_output.scheduled)
    assert query_lens[0] == 1 and query_lens[-1] > 1, query_lens  # decodes and a prefill
    with no_host_sync():
        inputs = runner.prepare_inputs(scheduler_output)
        hidden = runner.forward_hidden(inputs)
        logits = runner.model.compute_logits(hidden[inputs.logits_indices]).float()
        sampled = runner.sampler(logits, runner._sampling_batch(inputs.sampling_requests))
    assert len(sampled.tolist()) == len(inputs.sampling_requests)


def test_seeded_sampling_independent_of_batch(models):
    llm = make_llm(models("llama"), "bfloat16")
    prompts = ragged_prompts(4, seed=7)
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts, [seeded, others, others, others], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def test_kv_cache_sized_by_profiling(models):
    """No size given: the KV cache gets what a profiling step leaves of gpu_memory_utilization."""
    utilization = 0.03  # of 141 GB: a few GB, so that the block pool stays small
    # The limit covers the whole process: engines of earlier tests (another file's, when files
    # share a run: test_gpu_graphs.py's first left 3.2 GiB reserved on the H200, 2026-12-03)
    # must be gone and their cached blocks returned first.
    gc.collect()
    torch.cuda.empty_cache()
    llm = make_llm(
        models("llama"),
        "bfloat16",
        num_kv_blocks=None,
        gpu_memory_utilization=utilization,
        max_num_batched_tokens=2048,
    )
    engine = llm.engine
    free, total = torch.cuda.mem_get_info()
    kv_bytes = engine.num_kv_blocks * engine.runner.kv_cache_bytes_per_block()
    print(
        f"gpu_memory_utilization={utilization}: {engine.num_kv_blocks} KV blocks, "
        f"{kv_bytes / 2**30:.2f} GiB of {total / 2**30:.1f} GiB; torch reserves "
        f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB, {(total - free) / 2**30:.2f} GiB used"
    )
    assert kv_bytes <= utilization * total
    assert kv_bytes >= utilization * total - 2 * 2**30  # a tiny model leaves most of it
    assert total - free <= utilization * total + 256 * 2**20  # the whole process, near the limit
    prompts = ragged_prompts(4, seed=14)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(models("llama")), device="cuda", gpu_memory_utilization=1.5)
