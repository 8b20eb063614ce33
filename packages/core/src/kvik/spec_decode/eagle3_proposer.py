"""EAGLE-3 in the runner: the head of kvik.spec_decode.eagle3 fed with the target's hidden states.

The head reads, per position, the inputs of three target layers (``aux_hidden_state_layers``, as
vLLM names them: the checkpoint's ``eagle_aux_hidden_state_layer_ids`` or vLLM's default for the
target's depth). They are taken with forward pre-hooks on those decoder layers, so models need no
change; a layer's input is its residual stream ``hidden + residual`` (the fused form kvik's layers
hand on). Hooks only fire when the model's layers run from Python, so with EAGLE-3 every target
step runs eagerly (no CUDA graphs, no compiled pieces, no CPU one-call decode).

Per request the proposer keeps the head's input rows (``fc`` of the three states) of every
computed position whose token is known, and proposes with ``Eagle3Head.propose_greedy`` over the
last ``WINDOW`` rows: the head's one layer is recomputed over them at each draft step (the head
keeps no KV cache of its own yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvik.spec_decode.eagle3 import default_aux_layer_ids, load_eagle3_head
from kvik.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from kvik.worker.model_runner import ModelRunner

#: Head rows a proposal attends over (the newest ones).
WINDOW = 1024


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"EAGLE-3 needs a target whose decoder layers are model.layers; "
            f"{type(model).__name__} has none"
        )
    return layers


class Eagle3Proposer(Proposer):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        config = runner.config
        target = runner.model
        layers = _decoder_layers(target)
        embedding = target.model.embed_tokens
        self.head = load_eagle3_head(
            config.speculative.model, embedding, dtype=runner.dtype, device=runner.device
        )
        head_config = self.head.config
        hf = config.model.hf_config
        if head_config.vocab_size != config.model.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head's vocab_size is {head_config.vocab_size}, the target's "
                f"{config.model.vocab_size}: the head belongs to another model"
            )
        if head_config.target_hidden_size != hf.hidden_size:
            raise ValueError(
                f"the EAGLE-3 head reads hidden states of size {head_config.target_hidden_size}, "
                f"the target's are {hf.hidden_size}: the head belongs to another model"
            )
        ids = head_config.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(len(layers))
        if len(ids) != 3 or not all(0 <= i < len(layers) for i in ids):
            raise ValueError(
                f"EAGLE-3 reads three of the target's {len(layers)} layers; the head names {ids}"
            )
        self.aux_layer_ids = list(ids)
        self._captured: dict[int, Tensor] | None = None
        for i in self.aux_layer_ids:
            layers[i].register_forward_pre_hook(self._capture_hook(i))
        self._aux: Tensor | None = None
        # Per request: its head input rows, from position ``first[id]`` on.
        self.rows: dict[str, Tensor] = {}
        self.first: dict[str, int] = {}

    def _capture_hook(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._captured is not None:
                hidden, residual = args[1], args[2]
                self._captured[index] = hidden if residual is None else hidden + residual

        return hook

    def drop(self, request_id: str) -> None:
        self.rows.pop(request_id, None)
        self.first.pop(request_id, None)

    def run_target(self, inputs):
        self._captured = {}
        try:
            hidden = self.runner.step_runner.eager_hidden(inputs)
            aux = [self._captured[i] for i in self.aux_layer_ids]
        finally:
            self._captured = None
        self._aux = torch.cat(aux, dim=-1)[: inputs.num_tokens]
        logits = None
        if inputs.num_sampling:
            logits = self.runner.model.compute_logits(hidden[inputs.logits_indices]).float()
        return hidden, logits

    def propose(self, scheduler_output, inputs, new_tokens, caps):
        head_rows = self.head.combine(self._aux.to(self.head.fc.weight.dtype))
        self._aux = None
        for s, first_row in zip(scheduler_output.scheduled, inputs.query_starts, strict=True):
            request_id = s.request.request_id
            # Rows whose input token is known: all but rejected drafts.
            num_valid = s.num_tokens - len(s.spec_token_ids)
            if s.spec_token_ids:
                num_valid += len(new_tokens[request_id]) - 1
            self._keep(request_id, s.start, head_rows[first_row : first_row + num_valid])
        drafts = {}
        for request in inputs.sampling_requests:
            request_id = request.request_id
            cap = caps.get(request_id)
            if not cap:
                continue
            tokens = request.all_token_ids + new_tokens[request_id]
            first, rows = self.first[request_id], self.rows[request_id]
            # Row p pairs position p's hidden state with the token at p + 1.
            if first + rows.shape[0] != len(tokens) - 1:
                continue
            token_ids = torch.tensor(tokens[first + 1 :], device=rows.device)
            proposal = self.head.propose_greedy(token_ids[-WINDOW:], rows[-WINDOW:], cap)
            drafts[request_id] = proposal.tolist()
        return drafts

    def _keep(self, request_id: str, start: int, rows: Tensor) -> None:
        """Store rows for positions ``start...``; a recompute overwrites. After a gap (a prefix
        cache hit the target did not compute for this request) the rows start over there."""
        old = self.rows.get(request_id)
        first = self.first.get(request_id, start)
        if old is None or not first <= start <= first + old.shape[0]:
            self.rows[request_id], self.first[request_id] = rows, start
            return
        self.rows[request_id] = torch.cat([old[: start - first], rows])
