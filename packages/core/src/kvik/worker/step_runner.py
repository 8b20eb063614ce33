"""The step-runner seam: how a prepared step's forward pass runs on the device.

The model runner prepares a step in its persistent buffers (kvik.worker.step_buffers) and asks the
step runner for the logits of the rows that sample. The platform chooses the step runner
(``Platform.step_runner_class``): this one (eager, or compiled without graphs), kvik_cuda's
CUDA-graph runner (FULL graphs per padded decode batch size, PIECEWISE graphs of the compiled
model for the other steps), or kvik_cpu's one-call decode. Models carry no platform code: a step
runner wraps the model from outside.

With compilation mode 3 (``CompilationConfig.compiled``) the step runner holds the model compiled
piecewise (kvik.compilation.piecewise) and runs steps of two or more tokens through it; a subclass
wraps the compiled pieces (``wrap_piece``), e.g. in CUDA graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvik.compilation.piecewise import CompiledModel
from kvik.worker.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from kvik.worker.model_runner import ModelRunner
    from kvik.worker.step_io import StepInputs


class StepRunner:
    """Eager execution: the model's layers called one by one from Python."""

    name = "eager"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model
        compilation = runner.config.compilation
        self.compiled: CompiledModel | None = None
        if compilation.compiled:
            self.compiled = CompiledModel(
                self.model, self.wrap_piece, cache_dir=compilation.cache_dir or None
            )

    def wrap_piece(self, piece, index: int, count: int):
        """What runs compiled piece ``index`` of ``count``: the piece itself, without graphs."""
        return piece

    def uniform_batch_size(self, num_reqs: int, query_len: int) -> int | None:
        """The request count a uniform step (``num_reqs`` requests of ``query_len`` rows each, all
        sampling: 1 for decodes, 1 + k for verifications of k drafts) is padded to for a graph
        that replays it, or None where none does; padding requests have ``query_len`` rows, write
        no cache slot and read harmless keys."""
        return None

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The token count any other step's buffers are laid out for; rows past ``num_tokens``
        are padding that belongs to no request (slot -1, position 0)."""
        return num_tokens

    def reserved_memory_bytes(self) -> int:
        """Device memory this runner will hold beyond a forward pass (graphs), measured before the
        KV cache is sized; called with the model loaded and no KV cache."""
        return 0

    def on_kv_cache_ready(self) -> None:
        """The KV cache exists: warm up, capture graphs. A compiled model is compiled here, on a
        dummy step of two padding tokens, so that no request waits for it."""
        if self.compiled is not None and self.runner.max_num_seqs >= 2:
            with torch.inference_mode():  # as steps run: grad mode is part of dynamo's guards
                self.forward_hidden(self.runner.dummy_decode_inputs(2))

    def run_layers_in_python(self) -> None:
        """From now on every step runs the model's decoder layers from Python (or replays a graph
        captured from such a run), so that module hooks on them see each step: EAGLE-3 reads the
        hidden states of three layers that way. A compiled model runs its layers inside compiled
        code, where the hooks do not run: refused (the engine turns compilation off for EAGLE-3,
        kvik.spec_decode.config.speculative_compilation)."""
        if self.compiled is not None:
            raise ValueError(
                "module hooks on the model's layers (EAGLE-3's hidden states) need the layers run "
                "from Python: use compilation mode 0 (FULL CUDA graphs are fine)"
            )

    def forward_hidden(self, inputs: StepInputs) -> Tensor:
        """Hidden states [T, hidden] of the step's (padded) tokens: through the compiled model
        where there is one, else eagerly."""
        if self.compiled is None:
            return self.eager_hidden(inputs)
        context = ForwardContext(inputs.attn_metadata, self.runner.attention_layers)
        with forward_context(context):
            return self.compiled(inputs.input_ids, inputs.positions)

    def eager_hidden(self, inputs: StepInputs) -> Tensor:
        """Hidden states [T, hidden] from the model's layers called one by one."""
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
