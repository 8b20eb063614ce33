"""EAGLE-3 in the runner: the head of kvik.spec_decode.eagle3 fed with the target's hidden states.

The head reads, per position, the inputs of three target layers (``aux_hidden_state_layers``, as
vLLM names them: the checkpoint's ``eagle_aux_hidden_state_layer_ids`` or vLLM's default for the
target's depth). Forward pre-hooks on those decoder layers copy them (a layer's input is its
residual stream ``hidden + residual``, the fused form kvik's layers hand on) into a persistent
buffer ``aux`` [max_num_tokens, 3 * hidden], so models need no change, and a FULL CUDA graph
captured from the eagerly run layers records the copies and replays them. Compiled code does not
run hooks: the engine turns compilation off with EAGLE-3 (``speculative_compilation``), and the
CPU's one-call decode is turned off too (``StepRunner.run_layers_in_python``).

The head's one layer keeps a KV cache laid out in the target's blocks, as a draft model's is
(kvik.spec_decode.draft_model): a request's block table serves both, and its attention runs
through the runner's attention backend. After each target step (``propose``):

1. One batched pass of the head over all the step's rows writes its cache. Row ``p`` pairs the
   target's state at position ``p`` with the token at ``p + 1``: the next row's input token, or
   for a request's last known row the token the step sampled (or the prompt's next token). In a
   verification, the rows after the last accepted draft pair with rejected drafts: their keys are
   garbage, but they sit past the request's known tokens, and the draft steps below (and the next
   step's rows) overwrite them before anything reads them, as in vLLM's EAGLE proposer.
2. The first draft of every proposing request is the argmax at its last known row.
3. ``k - 1`` draft steps of one row per request, all requests at once: the row at the position
   after the previous one, fed with the previous draft and the previous row's pre-norm output as
   its hidden state, written into the cache at that position (the scheduler allocates these
   ``num_lookahead_tokens`` slots).

Under FULL graphs a decode or verification step's proposal replays as two graphs launched back to
back: the batched pass (with the rows the drafts start from), then the first drafts and the draft
steps, whose launch on the host overlaps the pass on the device. The host uploads a few indices a
request in one copy (its base row, block-table row and block count) and reads all drafts back in
one copy; one launch before the graphs (``kvik.ops.eagle3_indices``) works out on the device
every index they read: the last known rows and tokens from the step's accepted counts, the
pass's tokens, the draft steps' positions, slots and block table. The whole proposal is launched
behind the target's forward, before the step's tokens are read back, so at batch 1 what it adds
to a step is the head's time on the device (docs/benchmarks.md).

Drafts of the head over a reduced vocabulary map to target ids through ``d2t``.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvik import ops
from kvik.attention.backend import AttentionMetadata
from kvik.attention.selector import attach_attention
from kvik.layers.attention import Attention
from kvik.layers.rotary import RotaryEmbedding
from kvik.spec_decode.eagle3 import default_aux_layer_ids, load_eagle3_head
from kvik.spec_decode.proposer import Proposer
from kvik.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionOutput
from kvik.worker.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from kvik.platforms.base import StepGraphs
    from kvik.worker.model_runner import ModelRunner
    from kvik.worker.step_io import StepInputs

#: The head's attention layer in its forward context.
LAYER_NAME = "eagle3.midlayer.self_attn.attn"
#: "0": the head's batched pass and draft steps run eagerly even where the platform replays them
#: as CUDA graphs (the default with FULL graphs on).
DRAFT_GRAPHS_ENV = "KVIK_EAGLE3_DRAFT_GRAPHS"


def _fuse(linears: list[nn.Linear]) -> Tensor:
    """One weight for several bias-free products of the same input, each linear's weight then a
    view of its rows."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    at = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(fused[at : at + rows], requires_grad=False)
        at += rows
    return fused


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"EAGLE-3 needs a target whose decoder layers are model.layers; "
            f"{type(model).__name__} has none"
        )
    return layers


@dataclass
class _Launched:
    """A proposal on its way: the proposing requests (in draft-column order), how many rows of
    drafts come back, and the event of their copy to the host (None: already there)."""

    request_ids: list[str]
    num_rows: int
    copied: torch.Event | None


class Eagle3Proposer(Proposer):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        config = runner.config
        target = runner.model
        layers = _decoder_layers(target)
        self.head = load_eagle3_head(
            config.speculative.model,
            target.model.embed_tokens,
            dtype=runner.dtype,
            device=runner.device,
        )
        head_config = self.head.config
        hidden_size = config.model.hf_config.hidden_size
        if head_config.vocab_size != config.model.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head's vocab_size is {head_config.vocab_size}, the target's "
                f"{config.model.vocab_size}: the head belongs to another model"
            )
        if head_config.target_hidden_size != hidden_size:
            raise ValueError(
                f"the EAGLE-3 head reads hidden states of size {head_config.target_hidden_size}, "
                f"the target's are {hidden_size}: the head belongs to another model"
            )
        ids = head_config.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(len(layers))
        if len(ids) != 3 or not all(0 <= i < len(layers) for i in ids):
            raise ValueError(
                f"EAGLE-3 reads three of the target's {len(layers)} layers; the head names {ids}"
            )
        self.aux_layer_ids = list(ids)
        self.k = config.speculative.num_speculative_tokens
        device = runner.device
        # Written by the hooks at every forward of the target (graph captures included).
        self.aux = torch.zeros(
            runner.max_num_tokens, 3 * hidden_size, dtype=runner.dtype, device=device
        )
        for slot, i in enumerate(self.aux_layer_ids):
            columns = slice(slot * hidden_size, (slot + 1) * hidden_size)
            layers[i].register_forward_pre_hook(self._copy_hook(columns))
        runner.step_runner.run_layers_in_python()
        self._init_attention(runner)
        self._init_fused_layer(runner)
        self._init_draft_buffers(runner)

    def _copy_hook(self, columns: slice):
        def hook(module: nn.Module, args: tuple) -> None:
            hidden, residual = args[1], args[2]
            out = self.aux[: hidden.shape[0], columns]
            if residual is None:
                out.copy_(hidden)
            else:
                torch.add(hidden, residual, out=out)

        return hook

    def _init_attention(self, runner: ModelRunner) -> None:
        c = self.head.config
        self.attn = Attention(
            c.num_attention_heads, c.head_dim, c.head_dim**-0.5, c.num_key_value_heads, LAYER_NAME
        ).to(runner.device)
        # The head's cache holds the model's dtype (no FP8 scales of its own).
        self.cache_dtype = runner.dtype
        self.backend, self.builder = attach_attention(runner, [self.attn])
        # The head's own frequencies (its rope_theta and scaling, fp32: load_eagle3_head keeps
        # them so), over every position of the engine, in fp32 as kvik's rotary op reads them.
        freq = self.head.midlayer.self_attn.inv_freq
        t = torch.arange(runner.max_model_len, dtype=torch.float32, device=freq.device)
        angles = torch.outer(t, freq)
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.rotary = RotaryEmbedding(c.head_dim, cos_sin, is_neox=True)

    def _init_draft_buffers(self, runner: ModelRunner) -> None:
        """Persistent inputs of the draft steps (one row per proposing request), filled once per
        proposal: fixed addresses, so that the steps could be captured in a graph."""
        r, steps, device = runner.max_num_seqs, max(1, self.k - 1), runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        # Each draft step's positions, slots and sequence lengths, and the proposing requests'
        # block-table rows (in the attention's int32), written by ``eagle3_indices``.
        self.draft_seq_lens = torch.ones(steps, r, dtype=torch.int32, device=device)
        self.draft_positions = torch.zeros(steps, r, dtype=torch.int64, device=device)
        self.draft_slots = torch.full((steps, r), -1, dtype=torch.int64, device=device)
        self.draft_block_table = torch.zeros(r, self.max_blocks, dtype=torch.int32, device=device)
        self.draft_query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        self.draft_query_lens = torch.ones(r, dtype=torch.int32, device=device)
        hidden = self.head.config.hidden_size
        # The pre-norm rows the drafts start from, one per proposing request.
        self.draft_hidden = torch.zeros(r, hidden, dtype=runner.dtype, device=device)
        # Draft j of each proposing request at [j, request] (target ids), read back in one copy
        # into pinned memory.
        self.proposals = torch.zeros(max(1, self.k), r, dtype=torch.int64, device=device)
        self._proposals_host = torch.zeros(
            self.proposals.shape, dtype=torch.int64, pin_memory=device.type != "cpu"
        )
        # Draft ids -> target ids in one lookup (the head's map is target = draft + d2t[draft]).
        d2t = self.head.d2t
        self.target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        self._max_seq_len = 1
        # (host, device) int64 staging of each proposal's indices (``_upload``), of a fixed size
        # (what the largest proposal needs), so that a graph reads them at one address: the
        # batched pass's rows and tokens, the proposing requests' rows, block-table rows and block
        # counts, and what the first three are worked out from (``kvik.ops.eagle3_indices``),
        # max_num_seqs apart.
        capacity = 8 * r
        host = torch.zeros(capacity, dtype=torch.int64, pin_memory=device.type != "cpu")
        self._staging = (host, host if device.type == "cpu" else host.to(device))
        # The batched pass's token ids and outputs, where a graph replays it (``_pass_key``).
        self.pass_tokens = torch.zeros(runner.max_num_tokens, dtype=torch.int64, device=device)
        self.max_pass_rows = r * (self.k + 1)
        # The batched pass (decode and verification steps) and the draft steps (per padded batch
        # size) replayed as graphs (kvik_cuda), or None: all eagerly, the draft steps for exactly
        # the proposing requests. On with FULL graphs (on the H200 they cut a k = 3 proposal from
        # 3.5 to 1.6 ms: docs/benchmarks.md); KVIK_EAGLE3_DRAFT_GRAPHS=0 turns them off.
        self.graphs: StepGraphs | None = None
        capture_sizes = runner.config.compilation.cudagraph_capture_sizes
        self.graph_sizes = sorted(n for n in capture_sizes if n <= runner.max_num_seqs)
        if os.environ.get(DRAFT_GRAPHS_ENV) != "0" and runner.config.compilation.full_graphs:
            self.graphs = runner.platform.step_graphs()

    # --- KV cache ---------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        c = self.head.config
        return (
            2
            * self.runner.block_size
            * c.num_key_value_heads
            * c.head_dim
            * (self.cache_dtype.itemsize)
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks == 0:
            self.attn.kv_cache = None
            return
        c = self.head.config
        shape = self.backend.kv_cache_shape(
            num_blocks, self.runner.block_size, c.num_key_value_heads, c.head_dim
        )
        platform, device = self.runner.platform, self.runner.device
        self.attn.kv_cache = platform.zeroed_kv_cache(shape, self.cache_dtype, device)

    # --- the head's layer ---------------------------------------------------------------------
    def _init_fused_layer(self, runner: ModelRunner) -> None:
        """The layer's kernels as the target's layers run them: kvik's small ops (the attention
        input's embedding, two norms and concatenation in one launch, one launch for each other
        norm and for SiLU-and-multiply, the drafts' argmax and id map in one) and q/k/v and gate/up
        as one product each. The products stay on ``F.linear`` (cuBLAS on a GPU): on the H200
        the platform's one-row GEMV took longer over the head's shapes (docs/benchmarks.md).
        The head's own weights become views of the fused ones, so the reference path
        (``Eagle3Head.propose_greedy``) keeps working on the same memory."""
        with ops.ops_dispatch(runner.config.ops_dispatch or runner.platform.ops_dispatch):
            self._rms_norm = ops.small_op("rms_norm")
            self._fused_add_rms_norm = ops.small_op("fused_add_rms_norm")
            self._silu_and_mul = ops.small_op("silu_and_mul")
            self._embed_rms_norm_cat = ops.small_op("embed_rms_norm_cat")
            self._argmax_rows = ops.small_op("argmax_rows")
            self._eagle3_indices = ops.small_op("eagle3_indices")
        head = self.head
        attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
        self._qkv_weight = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self._qkv_sizes = [attn.q_proj.out_features, attn.k_proj.out_features,
                           attn.v_proj.out_features]  # fmt: skip
        self._gate_up_weight = _fuse([mlp.gate_proj, mlp.up_proj])
        # The embedding's rows as one table where they are whole on this rank (the fused input
        # reads them directly), else None: looked up through the module (its all-reduce).
        embedding = head.embedding()
        whole = getattr(embedding, "tp_size", 1) == 1
        self._embedding_table: Tensor | None = embedding.weight if whole else None

    def _layer(
        self, token_ids: Tensor, hidden: Tensor, positions: Tensor, common
    ) -> tuple[Tensor, Tensor]:
        """The head's layer over flat rows [T] through the paged cache: the MLP's output and the
        residual it adds to, whose sum is the pre-norm output [T, hidden] ``Eagle3Layer``
        computes (in the runner's kernels; left to the caller, which may fuse it with the
        final norm)."""
        layer = self.head.midlayer
        eps = layer.input_layernorm.eps
        if self._embedding_table is not None:
            x = self._embed_rms_norm_cat(
                token_ids,
                self._embedding_table,
                hidden,
                layer.input_layernorm.weight,
                layer.hidden_norm.weight,
                eps,
            )
            normed_hidden = x[:, hidden.shape[-1] :]
        else:
            normed_hidden = self._rms_norm(hidden, layer.hidden_norm.weight, eps)
            embeds = self._rms_norm(self.head.embed(token_ids), layer.input_layernorm.weight, eps)
            x = torch.cat([embeds, normed_hidden], dim=-1)
        residual = normed_hidden if layer.norm_before_residual else hidden
        q, k, v = F.linear(x, self._qkv_weight).split(self._qkv_sizes, dim=-1)
        context = ForwardContext(self.builder.build(common), {LAYER_NAME: self.attn})
        with forward_context(context):
            attended = self.attn(q, k, v, positions, self.rotary)
        normed, residual = self._fused_add_rms_norm(
            layer.self_attn.o_proj(attended), residual, layer.post_attention_layernorm.weight, eps
        )
        gate_up = F.linear(normed, self._gate_up_weight)
        return layer.mlp.down_proj(self._silu_and_mul(gate_up)), residual

    def _greedy(self, normed: Tensor, out: Tensor) -> Tensor:
        """Final-normed rows [B, hidden] -> greedy drafts [B] (target ids) in ``out``: the LM
        head's argmax mapped through ``target_ids``, in one launch where the platform has it."""
        self._argmax_rows(self.head.lm_head(normed), self.target_ids, out)
        return out

    # --- proposing ----------------------------------------------------------------------------
    proposes_on_device = True

    def launch(self, scheduler_output, inputs: StepInputs, verified, caps) -> _Launched:
        """The head's batched pass over the step's rows (writing its cache), then the drafts of
        the requests in ``caps``, started from the step's tokens on the device: nothing here
        waits for the device, so the host's part overlaps the target's forward. Each request's
        last row whose next token is known, and that token, follow from how many of its drafts
        the step accepted, worked out on the device (``kvik.ops.eagle3_indices``)."""
        scheduled = scheduler_output.scheduled
        sample_index, base_rows, prompt_next = [], [], []
        samples = 0
        for s, first_row in zip(scheduled, inputs.query_starts, strict=True):
            if s.samples:
                # Rows up to the newest token are known, then as many as it accepted drafts.
                sample_index.append(samples)
                samples += 1
                base_rows.append(first_row + s.num_tokens - len(s.spec_token_ids) - 1)
                prompt_next.append(0)
            else:  # a prompt chunk that does not sample: the prompt goes on
                sample_index.append(-1)
                base_rows.append(first_row + s.num_tokens - 1)
                prompt_next.append(s.request.all_token_ids[s.start + s.num_tokens])
        proposing = [(r, s) for r, s in enumerate(scheduled) if caps.get(s.request.request_id)]
        count = len(proposing)
        num_steps = max((caps[s.request.request_id] for _, s in proposing), default=1)
        steps = num_steps - 1
        size = self._graph_size(count) if steps else None
        if size is not None:
            steps = self.k - 1  # a graph always runs k - 1 steps (what its capture holds)
        # Per proposing request (then padding rows up to the graph's size): its row in the
        # step's block table (and in the step's requests), and how many blocks it has there.
        num_hidden = size or count
        padding = num_hidden - count
        table_rows = [r for r, _ in proposing] + [0] * padding
        num_blocks = [len(s.block_ids) for _, s in proposing] + [0] * padding
        if proposing:
            # The furthest a last known position can be: every draft accepted.
            last_positions = (s.start + s.num_tokens - 1 for _, s in proposing)
            self._max_seq_len = min(max(last_positions) + steps + 1, self.runner.max_model_len)
        num = len(scheduled)
        arrays = (num, num, num_hidden, table_rows, num_blocks, sample_index, base_rows,
                  prompt_next)  # fmt: skip
        staged = self._upload([a if isinstance(a, int) else np.array(a, np.int64) for a in arrays])
        # Every index the pass and the drafts read, worked out on the device in one launch
        # (where the platform has the kernel) from the staged ones and the step's tokens.
        bs = self.runner.block_size
        columns = min(self.max_blocks, -(-self._max_seq_len // bs)) if proposing else 0
        self._eagle3_indices(
            *staged[5:8], staged[3], staged[4],
            None if verified is None else verified.num_accepted,
            None if verified is None else verified.token_ids,
            inputs.input_ids, inputs.positions, inputs.common_metadata.block_table,
            *staged[:3], self.pass_tokens[: inputs.num_padded],
            self.draft_positions[:steps, :num_hidden], self.draft_slots[:steps, :num_hidden],
            self.draft_seq_lens[:steps, :num_hidden], self.draft_block_table[:num_hidden, :columns],
            bs, self.runner.max_model_len,
        )  # fmt: skip
        key = self._pass_key(inputs, scheduled)
        if key is None:
            prenorm = self._batched_pass(inputs)
            # The hidden states the drafts start from (padding rows keep stale, finite values:
            # their outputs are dropped and they write no cache).
            torch.index_select(prenorm, 0, staged[2][:count], out=self.draft_hidden[:count])
        else:
            # Two graphs, launched back to back: the host's launch of the drafts' (the larger)
            # overlaps the pass on the device; one graph of both would start later (a launch
            # costs the host about 1 µs a kernel, and the device waits for all of it).
            self.graphs.run(
                (*key, num_hidden),
                lambda: self._pass_and_hidden(inputs, staged, num_hidden),
            )
        request_ids = [s.request.request_id for _, s in proposing]
        if not proposing:
            return _Launched(request_ids, 0, None)
        if size is None:
            self._draft(inputs, staged, count, steps)
        else:
            self.graphs.run(
                ("draft", size, steps), lambda: self._draft(inputs, staged, size, steps)
            )
        host = self._proposals_host[: 1 + steps]
        if self.runner.device.type == "cpu":
            host.copy_(self.proposals[: 1 + steps])
            return _Launched(request_ids, 1 + steps, None)
        host.copy_(self.proposals[: 1 + steps], non_blocking=True)
        copied = torch.Event(self.runner.device.type)
        copied.record()
        return _Launched(request_ids, 1 + steps, copied)

    def propose(self, scheduler_output, inputs: StepInputs, new_tokens, caps, launched=None):
        """The drafts ``launch`` started, cut to the true ``caps``; without ``launched`` (a call
        with the step's tokens on the host only), launched here from them first."""
        if launched is None:
            launched = self.launch(
                scheduler_output, inputs, self._tokens_on_device(inputs, new_tokens), caps
            )
        if not launched.request_ids:
            return {}
        if launched.copied is not None:
            launched.copied.synchronize()
        count = len(launched.request_ids)
        proposals = self._proposals_host[: launched.num_rows, :count].T.tolist()
        return {
            request_id: proposals[i][: caps[request_id]]
            for i, request_id in enumerate(launched.request_ids)
            if caps.get(request_id)
        }

    def _tokens_on_device(self, inputs: StepInputs, new_tokens) -> RejectionOutput | None:
        """Host tokens of the step's sampling requests as the rejection sampler leaves them."""
        rows = [new_tokens[r.request_id] for r in inputs.sampling_requests]
        if not rows:
            return None
        width = max(len(row) for row in rows)
        padded = [row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)) for row in rows]
        device = self.runner.device
        return RejectionOutput(
            torch.tensor(padded, dtype=torch.int64, device=device),
            torch.tensor([len(row) - 1 for row in rows], dtype=torch.int64, device=device),
        )

    def _graph_size(self, count: int) -> int | None:
        """The padded batch size whose graph runs ``count`` requests' draft steps (None: they
        run eagerly)."""
        if self.graphs is None or self.k < 2 or not self.graph_sizes:
            return None
        if count > self.graph_sizes[-1]:
            return None
        return self.graph_sizes[bisect.bisect_left(self.graph_sizes, count)]

    def _upload(self, arrays: list[np.ndarray | int]) -> list[Tensor]:
        """int64 arrays of at most max_num_seqs each -> device views, array i at staging offset
        i * max_num_seqs (so that a graph finds each at one address whatever the others' sizes),
        through one host-to-device copy (from pinned memory on a GPU; the previous proposal's
        read-back has waited for its copy, so the host may overwrite the staging). An int in
        place of an array: a slot of that many entries the device fills (after the copy)."""
        host, staged = self._staging
        stride = self.runner.max_num_seqs
        host_np = host.numpy()
        views = []
        for i, a in enumerate(arrays):
            n = a if isinstance(a, int) else a.size
            if n > stride:
                raise RuntimeError(f"a proposal stages {n} indices, more than {stride}")
            if not isinstance(a, int):
                host_np[i * stride : i * stride + n] = a
            views.append((i * stride, n))
        end = views[-1][0] + views[-1][1]
        if staged is not host:
            staged[:end].copy_(host[:end], non_blocking=True)
        return [staged[at : at + n] for at, n in views]

    def _pass_key(self, inputs: StepInputs, scheduled) -> tuple | None:
        """The graph key of the step's batched pass, or None to run it eagerly: a graph holds
        decode and verification steps (every request samples after at most k drafts), keyed by
        what fixes its launches (token and request counts, the longest query)."""
        if self.graphs is None or inputs.num_padded > self.max_pass_rows:
            return None
        if not all(s.samples for s in scheduled):
            return None
        common = inputs.common_metadata
        if common.max_query_len > self.k + 1:
            return None
        return ("pass", inputs.num_padded, common.num_reqs, common.max_query_len, len(scheduled))

    def _batched_pass(self, inputs: StepInputs) -> Tensor:
        """The head over every row of the step (its cache written at the step's slots): pre-norm
        outputs [T_pad, hidden]. Every input is a persistent buffer (the runner's step buffers,
        ``aux``, ``pass_tokens``), so a graph can replay it."""
        num_rows = inputs.num_padded
        hidden = self.head.combine(self.aux[:num_rows])
        mlp_out, residual = self._layer(
            self.pass_tokens[:num_rows], hidden, inputs.positions, inputs.common_metadata
        )
        return mlp_out + residual

    def _pass_and_hidden(self, inputs: StepInputs, staged: list[Tensor], num_hidden: int) -> None:
        """The batched pass, then the rows the drafts start from into ``draft_hidden``: what the
        pass's graph holds."""
        prenorm = self._batched_pass(inputs)
        torch.index_select(prenorm, 0, staged[2][:num_hidden], out=self.draft_hidden[:num_hidden])

    def _draft(self, inputs: StepInputs, staged: list[Tensor], size: int, steps: int) -> None:
        """The drafts of ``size`` rows (proposing requests, then padding) into ``proposals``: the
        first from ``draft_hidden``, then ``steps`` one-row-per-request passes of the head, each
        fed with the previous draft and the previous row's pre-norm output. On persistent
        buffers only (the draft steps' positions, slots, sequence lengths and block table, which
        ``eagle3_indices`` wrote), so that a graph can hold it all. A graph's steps past a
        request's cap stay within the rotary table (their drafts are dropped), and a slot past
        the request's blocks (or on a padding row) is -1: not written."""
        norm = self.head.norm
        hidden = self.draft_hidden[:size]
        tokens = self._greedy(
            self._rms_norm(hidden, norm.weight, norm.eps), self.proposals[0, :size]
        )
        for step in range(steps):
            common = AttentionMetadata(
                num_actual_tokens=size,
                num_reqs=size,
                query_start_loc=self.draft_query_start_loc[: size + 1],
                query_lens=self.draft_query_lens[:size],
                seq_lens=self.draft_seq_lens[step, :size],
                block_table=self.draft_block_table[:size],
                slot_mapping=self.draft_slots[step, :size],
                max_query_len=1,
                max_seq_len=self._max_seq_len,
                block_size=self.runner.block_size,
            )
            positions = self.draft_positions[step, :size]
            mlp_out, residual = self._layer(tokens, hidden, positions, common)
            # The pre-norm output (the next step's hidden input) and its final norm, at once.
            normed, hidden = self._fused_add_rms_norm(mlp_out, residual, norm.weight, norm.eps)
            tokens = self._greedy(normed, self.proposals[step + 1, :size])
