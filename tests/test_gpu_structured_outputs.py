"""Structured outputs on a GPU (the lead runs it on the H200): the grammar's mask is applied to the
logits on the device, so a grammar that forbids the greedy token changes the output and one that
allows everything leaves greedy outputs equal. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from structured_output_checks import (
    check_allowing_everything_leaves_greedy_outputs_equal,
    check_forbidding_the_greedy_token_changes_the_output,
    full_vocab_model,
    make_llm,
    padded_vocab_model,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forbidding_the_greedy_token_changes_the_output_on_the_gpu(tmp_path, async_scheduling):
    llm = make_llm(padded_vocab_model(tmp_path), "cuda", async_scheduling=async_scheduling)
    check_forbidding_the_greedy_token_changes_the_output(llm)


def test_allowing_everything_leaves_greedy_outputs_equal_on_the_gpu(tmp_path):
    check_allowing_everything_leaves_greedy_outputs_equal(
        make_llm(full_vocab_model(tmp_path), "cuda")
    )
