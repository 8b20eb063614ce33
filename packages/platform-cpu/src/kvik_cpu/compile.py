"""The CPU's compiled forward pass: TorchInductor turns the model's small ops into fused C++ loops.

In eager mode a decoder layer runs dozens of small PyTorch ops per step (norms, rotary, activation),
each costing microseconds of dispatch, which at batch 1 adds up to as much as the matrix products.
Inductor fuses them; with ``freezing`` it also treats the weights as constants and prepacks them
for oneDNN itself. Attention stays one opaque op (``kvik::unified_attention``) called from the
compiled code, so the compiled graph holds no per-step metadata and is compiled once for a dynamic
number of tokens (plus once for a single token, which TorchDynamo specialises).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._inductor.config
from torch import Tensor, nn

CPP_WRAPPER = __import__("os").environ.get("KVIK_CPPW") == "1"
UNBACKED = __import__("os").environ.get("KVIK_UNBACKED") == "1"


def compile_forward(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    compiled = torch.compile(model.forward, dynamic=True)

    compiled_shapes: set[bool] = set()

    def forward(input_ids: Tensor, positions: Tensor) -> Tensor:
        single = input_ids.shape[0] == 1
        if single in compiled_shapes:
            # Compiled for this shape already: check only the guards that tell the two compiled
            # graphs apart (one token or many). Checking all of them, one per weight and more,
            # costs about 1.5 ms a step at batch 1.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return compiled(input_ids, positions)
        if UNBACKED:
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
        # Freezing is read while TorchDynamo traces, outside ``torch.compile(options=...)``'s
        # reach: set it (for this call only, not for the user's other compiled code) here.
        with torch._inductor.config.patch(freezing=True, cpp_wrapper=CPP_WRAPPER):
            hidden = compiled(input_ids, positions)
        compiled_shapes.add(single)
        return hidden

    return forward
