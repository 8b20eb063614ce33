"""EAGLE-3 on a CUDA GPU with FULL graphs; skipped without CUDA.

The hooks that take the target's aux hidden states copy them into a persistent buffer, so a FULL
graph captured from the eagerly run layers replays the copies: after a replayed decode step the
buffer holds transformers' hidden states of that position. Greedy outputs with a random head equal
plain decoding's (fp32), and the head's proposals equal the window-recompute reference, with the
draft steps replayed as graphs (the default) and run eagerly (KVIK_EAGLE3_DRAFT_GRAPHS=0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Helpers from test_gpu_e2e.py beside this file and from the repository's top-level tests/.
sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[3] / "tests"),
]
from test_eagle3_proposer import WindowReference  # noqa: E402
from test_gpu_e2e import _free_gpu_memory, make_llm, models  # noqa: F401, E402  (fixtures)
from test_spec_decode_engine import random_eagle3_head  # noqa: E402
from tiny_models import load_hf, ragged_prompts  # noqa: E402

from kvik import SamplingParams  # noqa: E402
from kvik.spec_decode.eagle3_proposer import DRAFT_GRAPHS_ENV  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

K = 3
AUX_LAYERS = (1, 0, 1)


def eagle3_llm(folder: Path, head: Path):
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    return make_llm(folder, "float32", cudagraph_mode="full", speculative_config=config)


def test_graph_replay_copies_the_aux_states(models, tmp_path):  # noqa: F811 (fixtures)
    folder = models("llama")
    llm = eagle3_llm(folder, random_eagle3_head(tmp_path / "head", folder, AUX_LAYERS))
    runner = llm.engine.runner
    prompt = ragged_prompts(1, seed=3, low=20, high=21)[0]
    replays = runner.step_runner.num_replays
    # Two tokens: the prompt's step, then one decode step (no drafts: max_tokens leaves no room),
    # replayed in the batch-1 graph.
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first, _ = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    assert runner.step_runner.num_replays == replays + 1
    aux = runner.proposer.aux[0].view(3, -1)
    hf = load_hf(folder).cuda()
    with torch.no_grad():
        states = hf(torch.tensor([prompt + [first]], device="cuda"), output_hidden_states=True)
    for slot, layer in enumerate(AUX_LAYERS):
        expected = states.hidden_states[layer][0, len(prompt)]
        torch.testing.assert_close(aux[slot], expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("draft_graphs", [False, True], ids=["eager-drafts", "graphed-drafts"])
def test_greedy_identical_and_proposals_equal_reference(
    models,  # noqa: F811 (fixtures)
    tmp_path,
    monkeypatch,
    draft_graphs,
):
    folder = models("llama")
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(3, seed=5, low=5, high=40)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(3)
    ]
    plain = make_llm(folder, "float32", cudagraph_mode="full")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    del plain
    monkeypatch.setenv(DRAFT_GRAPHS_ENV, "1" if draft_graphs else "0")
    llm = eagle3_llm(folder, random_eagle3_head(tmp_path / "head", folder))
    proposer = llm.engine.runner.proposer
    assert (proposer.graphs is not None) == draft_graphs
    reference = WindowReference(proposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert reference.compared > 10
    if draft_graphs:
        keys = set(proposer.graphs.graphs)
        # ("draft", batch size, draft steps): one graph per padded batch size a step used
        assert {("draft", 1), ("draft", 2), ("draft", 4)} <= {key[:2] for key in keys}
        assert any(key[0] == "pass" for key in keys)  # the batched pass of verifications
