"""EAGLE-3 in the runner (kvik.spec_decode.eagle3_proposer): its proposals, made through the head's
own KV cache for all requests at once, equal token for token (fp32) those of the reference that
recomputes the head's layer over each request's rows at every draft step
(``Eagle3Head.propose_greedy``, what the runner did before the cache); a head trained on the
target's own generations gets its drafts accepted through the runner; greedy outputs equal plain
decoding's; and the paths that would bypass the hooks (the CPU's one-call decode) are off."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode_engine import PROMPTS, generate, make_llm, random_eagle3_head

from kvik import SamplingParams
from kvik.spec_decode import train_eagle3 as trainer
from kvik.spec_decode.eagle3 import save_eagle3_head

K = 3
GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1)


class WindowReference:
    """Wraps a runner's Eagle3Proposer: after every proposal, the head's input rows of each
    request's known positions (``fc`` of the aux states the hooks copied) are kept, and the
    drafts are checked against ``propose_greedy`` over all of them."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.rows: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, list[int]] = {}
        self.compared = 0
        self.prefix_hits = 0
        propose = proposer.propose

        def checked(scheduler_output, inputs, new_tokens, caps, launched=None):
            aux = proposer.aux[: inputs.num_tokens].clone()  # the head reads it, never writes
            drafts = propose(scheduler_output, inputs, new_tokens, caps, launched=launched)
            self.check(scheduler_output, inputs, new_tokens, caps, aux, drafts)
            return drafts

        proposer.propose = checked

    def _rows_of_prefix(self, prefix: list[int]) -> torch.Tensor:
        """The rows of an earlier request whose tokens start with ``prefix`` (a row depends on
        the tokens up to its position only)."""
        for request_id, tokens in self.tokens.items():
            rows = self.rows[request_id]
            if tokens[: len(prefix)] == prefix and rows.shape[0] >= len(prefix):
                return rows[: len(prefix)]
        raise AssertionError(f"no earlier request computed the {len(prefix)} cached positions")

    @torch.no_grad()
    def check(self, scheduler_output, inputs, new_tokens, caps, aux, drafts) -> None:
        head = self.proposer.head
        head_rows = head.combine(aux)
        for s, first_row in zip(scheduler_output.scheduled, inputs.query_starts, strict=True):
            request_id = s.request.request_id
            new = new_tokens.get(request_id, []) if s.samples else []
            # Rows whose next token is known: all but those of rejected drafts.
            num_valid = s.num_tokens - len(s.spec_token_ids) + max(0, len(new) - 1)
            kept = self.rows.get(request_id, head_rows[:0])[: s.start]
            if kept.shape[0] < s.start:  # a prefix cache hit: rows another request computed
                kept = self._rows_of_prefix(s.request.all_token_ids[: s.start])
                self.prefix_hits += 1
            self.rows[request_id] = torch.cat([kept, head_rows[first_row : first_row + num_valid]])
            self.tokens[request_id] = list(s.request.all_token_ids) + list(new)
        for request in inputs.sampling_requests:
            request_id = request.request_id
            cap = caps.get(request_id)
            if not cap:
                assert request_id not in drafts
                continue
            tokens = request.all_token_ids + new_tokens[request_id]
            rows = self.rows[request_id]
            assert rows.shape[0] == len(tokens) - 1
            token_ids = torch.tensor(tokens[1:], device=rows.device)
            expected = head.propose_greedy(token_ids, rows, cap).tolist()
            assert drafts[request_id] == expected, request_id
            self.compared += 1


def proposer_of(llm):
    return llm.engine.runner.proposer


@pytest.fixture(scope="module")
def plain(tiny_model):
    return generate(make_llm(tiny_model("llama")))


@pytest.fixture(scope="module")
def trained_head(tiny_model, tmp_path_factory):
    """A head trained (briefly, on CPU) on the target's greedy continuations of the test prompts:
    its drafts are often right, so acceptance exercises partial and full accepts."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model("llama")
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # The answers' first half only: the rest is new to the head, which then errs now and then.
    sequences = trainer.greedy_continuations(target, PROMPTS, max_new_tokens=20, batch_size=3)
    aux_ids = [0, 1, 1]
    examples = trainer.collect_examples(
        target, sequences, aux_ids, prompt_lengths=[len(p) for p in PROMPTS]
    )
    head = trainer.new_head(target, torch.arange(target.config.vocab_size))
    head.config.eagle_aux_hidden_state_layer_ids = aux_ids
    torch.manual_seed(0)
    trainer.train_head(head, examples, steps=80, batch_size=3, lr=3e-3, log_every=0)
    out = tmp_path_factory.mktemp("trained-head")
    save_eagle3_head(head, out)
    return out


@pytest.mark.parametrize(
    "budget", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 3}], ids=["default", "chunked"]
)
def test_cached_proposals_equal_window_recompute(tiny_model, plain, tmp_path, budget):
    target = tiny_model("llama")
    head = random_eagle3_head(tmp_path / "head", target)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    llm = make_llm(target, config, **budget)
    reference = WindowReference(proposer_of(llm))
    assert generate(llm) == plain
    assert reference.compared > 20


def test_prefix_cache_hits_read_the_heads_cache(tiny_model, plain, tmp_path):
    """A request whose prompt is in the prefix cache computes only its tail: the head's keys of
    the cached positions, written by the request that computed them, serve it."""
    target = tiny_model("llama")
    head = random_eagle3_head(tmp_path / "head", target)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    llm = make_llm(target, config, enable_prefix_caching=True)
    reference = WindowReference(proposer_of(llm))
    assert generate(llm, prompts=PROMPTS[1:2]) == plain[1:2]
    assert generate(llm, prompts=PROMPTS[1:2]) == plain[1:2]
    assert reference.prefix_hits == 1 and reference.compared > 10


class EagerStepGraphs:
    """``StepGraphs`` for the CPU, which cannot replay graphs: the work of a key runs each time,
    and as a replay would, the draft steps' keys rerun the closure seen first (not the one passed
    now), so drafts computed from anything but the persistent buffers it was built on (a fresh
    tensor of a later proposal, a shape of another) come out wrong and fail the comparison."""

    def __init__(self) -> None:
        self.sizes: list[tuple] = []  # the keys run, in order
        self.first: dict[tuple, object] = {}

    def run(self, key, fn) -> None:
        self.sizes.append(key)
        if key[0] in ("draft", "pass"):
            fn = self.first.setdefault(key, fn)
        fn()


def test_padded_draft_steps_equal_window_recompute(tiny_model, plain, tmp_path):
    target = tiny_model("llama")
    head = random_eagle3_head(tmp_path / "head", target)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    llm = make_llm(target, config, max_num_seqs=4)
    proposer = proposer_of(llm)
    graphs = proposer.graphs = EagerStepGraphs()
    proposer.graph_sizes = [2, 4]
    reference = WindowReference(proposer)
    assert generate(llm) == plain
    assert draft_sizes(graphs) == {4}  # three requests: padded to 4
    assert generate(llm, prompts=PROMPTS[:1]) == plain[:1]
    assert draft_sizes(graphs) == {2, 4}  # one request: padded to 2
    assert reference.compared > 20
    # The batched pass of decode and verification steps: one or three requests, k + 1 rows at most; prompt steps run outside graphs.
    passes = pass_keys(graphs)
    assert {key[3] for key in passes} == {1, 3} and max(key[2] for key in passes) <= K + 1


def draft_sizes(graphs: EagerStepGraphs) -> set[int]:
    return {key[1] for key in graphs.sizes if key[0] == "draft"}


def pass_keys(graphs: EagerStepGraphs) -> set[tuple]:
    """(padded rows, padded requests, longest query, requests) of each graphed batched pass."""
    return {key[1:5] for key in graphs.sizes if key[0] == "pass"}


def test_trained_head_is_accepted_through_the_runner(tiny_model, plain, trained_head):
    config = {"method": "eagle3", "model": str(trained_head), "num_speculative_tokens": K}
    llm = make_llm(tiny_model("llama"), config)
    reference = WindowReference(proposer_of(llm))
    assert generate(llm) == plain
    assert reference.compared > 10
    stats = llm.stats.spec_decoding
    # Partial accepts (and rejections) as well as full ones: every path of the cache's rows.
    per_position = stats.num_accepted_tokens_per_pos
    assert per_position[0] > per_position[K - 1] > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.mean_accepted_length > 1.5  # 1.73 measured (a random head's: about 1.0)


def test_padded_verification_layout(tiny_model, plain, trained_head):
    """Verifications laid out as kvik_cuda's FULL graphs replay them (1 + k rows a request, fewer
    drafts padded inside the request, padding requests after; decodes padded to 4 requests), with
    the head's pass and draft steps on their fixed-shape path: proposals equal the reference's."""
    config = {"method": "eagle3", "model": str(trained_head), "num_speculative_tokens": K}
    llm = make_llm(tiny_model("llama"), config, max_num_seqs=4)
    runner = llm.engine.runner
    runner.step_runner.uniform_batch_size = lambda n, rows: 4 if n <= 4 else None
    proposer = proposer_of(llm)
    graphs = proposer.graphs = EagerStepGraphs()
    proposer.graph_sizes = [2, 4]
    reference = WindowReference(proposer)
    assert generate(llm) == plain
    assert reference.compared > 10 and llm.stats.spec_decoding.num_accepted_tokens > 0
    # Verifications of 4 rows a request
    passes = pass_keys(graphs)
    assert any(rows == 16 and reqs == 4 and query == K + 1 for rows, reqs, query, _ in passes)


def test_aux_states_are_the_target_layers_inputs(tiny_model, tmp_path):
    """What the hooks copy into the proposer's buffer is each aux layer's input (transformers'
    ``hidden_states[i]``) at every row of the step."""
    from tiny_models import load_hf

    target = tiny_model("llama")
    head = random_eagle3_head(tmp_path / "head", target, aux_layers=(1, 0, 1))
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    llm = make_llm(target, config)
    prompt = PROMPTS[1]
    generate(llm, GREEDY_ONE, prompts=[prompt])  # one step: the whole prompt
    aux = proposer_of(llm).aux[: len(prompt)].view(len(prompt), 3, -1)
    with torch.no_grad():
        states = load_hf(target)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for slot, layer in enumerate((1, 0, 1)):
        torch.testing.assert_close(aux[:, slot], states[layer][0], rtol=1e-4, atol=1e-4)


def test_cpu_one_call_decode_is_off(tiny_model, tmp_path):
    """The CPU's one-call decode (AMX CPUs, bf16) runs the layers in C++, where no hook sees
    them: with EAGLE-3 it is off, and greedy outputs equal those of the plain engine (which
    uses it)."""
    from kvik import LLM

    target = tiny_model("llama")
    plain = LLM(str(target), dtype="bfloat16", block_size=16, num_kv_blocks=256)
    if plain.engine.runner.step_runner.decode_layers is None:
        pytest.skip("this CPU has no one-call decode (it needs AMX)")
    head = random_eagle3_head(tmp_path / "head", target)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    llm = LLM(
        str(target), dtype="bfloat16", block_size=16, num_kv_blocks=256, speculative_config=config
    )
    assert llm.engine.runner.step_runner.decode_layers is None
    assert generate(llm) == generate(plain)
