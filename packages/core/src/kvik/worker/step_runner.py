"""The step-runner seam: how a prepared step's forward pass runs on the device.

The model runner prepares a step in its persistent buffers (kvik.worker.step_buffers) and asks the
step runner for the logits of the rows that sample. The platform chooses the step runner
(``Platform.step_runner_class``): this eager one, kvik_cuda's CUDA-graph runner (one FULL graph per
padded decode batch size), or kvik_cpu's one-call decode. Models carry no platform code: a step
runner wraps the model from outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from kvik.worker.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from kvik.worker.model_runner import ModelRunner, StepInputs


class StepRunner:
    """Eager execution: the model's layers called one by one from Python."""

    name = "eager"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool) -> int:
        """The token (and, for uniform decodes, request) count the step's buffers are laid out
        for; rows past ``num_tokens`` are padding (slot -1, sequence length 1, position 0)."""
        return num_tokens

    def reserved_memory_bytes(self) -> int:
        """Device memory this runner will hold beyond a forward pass (graphs), measured before the
        KV cache is sized; called with the model loaded and no KV cache."""
        return 0

    def on_kv_cache_ready(self) -> None:
        """The KV cache exists: warm up, capture graphs."""

    def forward_hidden(self, inputs: StepInputs) -> Tensor:
        """Hidden states [T, hidden] of the step's (padded) tokens."""
        context = ForwardContext(inputs.attn_metadata, self.runner.attention_layers)
        with forward_context(context):
            return self.model(inputs.input_ids, inputs.positions)

    def forward(self, inputs: StepInputs) -> tuple[Tensor | None, Tensor | None]:
        """(hidden states or None, fp32 logits of the sampling rows or None when none samples).

        Hidden states are needed only for prompt logprobs; a runner that replays a graph for a
        step without them may return None.
        """
        hidden = self.forward_hidden(inputs)
        if inputs.num_sampling == 0:
            return hidden, None
        return hidden, self.model.compute_logits(hidden[inputs.logits_indices]).float()
