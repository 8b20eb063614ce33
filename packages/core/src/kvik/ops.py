"""kvik's small ops as ``torch.library`` ops, each with its PyTorch reference implementation
(defined by ``kvik.op_library.custom_op``, which has ``torch.library.custom_op``'s signature without
its per-call Python layers).

The references run on every device. A platform registers faster kernels for its own device key when
it is selected (``torch.library.register_kernel("kvik::rms_norm", "cuda", fn)``), never on import,
because ROCm builds of torch use the CUDA key too. ``torch.compile`` sees each op as one node.
Attention goes through its op only under ``torch.compile``; eagerly the attention layer calls its
backend, which writes the cache itself (kvik.layers.attention).

How the layers call the small ops (rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul,
fused_moe; the samplers' argmax_rows; an EAGLE-3 head's embed_rms_norm_cat and eagle3_indices) is an
engine's choice, ``ops_dispatch`` (``Platform.ops_dispatch``, or the engine option):

- ``"torch_ops"``: through ``torch.ops.kvik.*``, so dispatch follows the tensors' device to the
  kernels the platform registered (CUDA's Triton kernels, the CPU's C++ ones). A platform with
  kernels of its own chooses this.
- ``"direct"``: the references above, called as plain Python functions. A platform whose kernels
  for these ops would be the references anyway (the CPU when its C++ ops did not build) chooses
  this: it skips the custom-op dispatch, a cost on every call in eager mode that
  docs/benchmarks.md measures, and lets ``torch.compile`` fuse the ops into its own loops instead
  of calling an opaque op.

Layers resolve the choice once, when they are built: the runner builds its model inside
``ops_dispatch(choice)``, which holds for that build only (a context variable), so two engines in
one process each get their own, and a layer built outside any engine calls ``torch.ops.kvik``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from kvik.config import OPS_DISPATCHES, OpsDispatch
from kvik.op_library import custom_op

_dispatch: ContextVar[OpsDispatch] = ContextVar("kvik_ops_dispatch", default="torch_ops")


@contextmanager
def ops_dispatch(choice: OpsDispatch) -> Iterator[None]:
    """Layers built inside call the small ops as ``choice`` says ("torch_ops" or "direct")."""
    if choice not in OPS_DISPATCHES:
        raise ValueError(f"ops_dispatch must be one of {OPS_DISPATCHES}, got {choice!r}")
    token = _dispatch.set(choice)
    try:
        yield
    finally:
        _dispatch.reset(token)


def small_op(name: str) -> Callable:
    """What a layer being built calls for the small op ``name`` (say "rms_norm"): the custom op
    ``torch.ops.kvik.<name>``, or its reference where the build's dispatch is "direct"."""
    if _dispatch.get() == "direct":
        return _REFERENCES[name]
    return getattr(torch.ops.kvik, name)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # As Hugging Face: normalise in fp32, scale by the weight in the input dtype.
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


rms_norm = custom_op("kvik::rms_norm", _rms_norm, mutates_args=())


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


def _fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the next layer's input and residual."""
    summed = x + residual
    return _rms_norm(summed, weight, eps), summed


fused_add_rms_norm = custom_op("kvik::fused_add_rms_norm", _fused_add_rms_norm, mutates_args=())


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    # x: [T, H, rot_dim]; cos, sin: [T, 1, rot_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox: bool,
) -> tuple[Tensor, Tensor]:
    """Rotate the first ``rot_dim`` dims of every head of query [T, H*D] and key [T, Hk*D].

    ``cos_sin_cache`` is [max_position, rot_dim]: cos in the first half, sin in the second, fp32.
    ``is_neox`` pairs dim i with i + rot_dim/2 (Llama, Hugging Face's rotate_half); otherwise
    adjacent dims (GPT-J).
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot_dim/2]

    def apply(x: Tensor) -> Tensor:
        t = x.shape[0]
        x = x.view(t, -1, head_size)
        rotated = _rotate(x[..., :rot_dim].float(), cos, sin, is_neox).to(x.dtype)
        if rot_dim < head_size:  # partial rotary: the other dims pass through
            rotated = torch.cat((rotated, x[..., rot_dim:]), dim=-1)
        return rotated.reshape(t, -1)

    return apply(query), apply(key)


rotary_embedding = custom_op("kvik::rotary_embedding", _rotary_embedding, mutates_args=())


@rotary_embedding.register_fake
def _(positions, query, key, head_size, cos_sin_cache, is_neox):
    return torch.empty_like(query), torch.empty_like(key)


def _silu_and_mul(x: Tensor) -> Tensor:
    """x: [T, 2*I] holding gate then up projections -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


silu_and_mul = custom_op("kvik::silu_and_mul", _silu_and_mul, mutates_args=())


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _argmax_rows(logits: Tensor, index_map: Tensor | None, out: Tensor) -> None:
    """``out[r]``: the index of row r's largest logit (the first on ties; NaN ranks highest),
    through ``index_map`` where one is given (an EAGLE-3 head's draft ids to target ids)."""
    # max(dim).indices, not argmax: the same first maximal index, and much faster on the CPU
    # over a batch of large-vocabulary rows (docs/benchmarks.md).
    ids = logits.max(dim=-1).indices
    out.copy_(ids if index_map is None else index_map[ids])


argmax_rows = custom_op("kvik::argmax_rows", _argmax_rows, mutates_args=("out",))


@argmax_rows.register_fake
def _(logits: Tensor, index_map: Tensor | None, out: Tensor) -> None:
    return None


def _embed_rms_norm_cat(
    token_ids: Tensor,
    embedding: Tensor,
    hidden: Tensor,
    embed_norm_weight: Tensor,
    hidden_norm_weight: Tensor,
    eps: float,
) -> Tensor:
    """An EAGLE-3 layer's attention input: the tokens' embedding rows and the hidden states [T, H],
    each RMS-normed with its own weight, side by side: [T, 2 * H] in ``hidden``'s dtype."""
    embeds = embedding[token_ids].to(hidden.dtype)
    return torch.cat(
        [_rms_norm(embeds, embed_norm_weight, eps), _rms_norm(hidden, hidden_norm_weight, eps)],
        dim=-1,
    )


embed_rms_norm_cat = custom_op("kvik::embed_rms_norm_cat", _embed_rms_norm_cat, mutates_args=())


@embed_rms_norm_cat.register_fake
def _(token_ids, embedding, hidden, embed_norm_weight, hidden_norm_weight, eps) -> Tensor:
    return hidden.new_empty(*hidden.shape[:-1], 2 * hidden.shape[-1])


def moe_routing(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Softmax over the experts in fp32, then the ``top_k`` most probable: (weights [T, top_k]
    fp32, expert ids [T, top_k] int64), the weights rescaled to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_fused_moe_shapes(
    hidden: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int
) -> None:
    """The fused MoE op's contract, checked before any kernel runs (a clear error, not a crash)."""
    tokens, size = hidden.shape
    experts, two_inter, width = w13.shape
    if width != size or w2.shape != (experts, size, two_inter // 2) or two_inter % 2:
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} must be [E, 2I, {size}] and w2 "
            f"{tuple(w2.shape)} [E, {size}, I] for hidden states of width {size}"
        )
    if router_logits.shape != (tokens, experts):
        raise ValueError(
            f"fused_moe: router logits {tuple(router_logits.shape)} must be [{tokens}, {experts}]"
        )
    if not 1 <= top_k <= experts:
        raise ValueError(f"fused_moe: top_k must be in [1, {experts}], got {top_k}")


def grouped_experts(
    hidden: Tensor,
    router_logits: Tensor,
    top_k: int,
    renormalize: bool,
    expert: Callable[[int, Tensor], Tensor] | None = None,
    all_experts: Callable[[Tensor, list[int]], Tensor] | None = None,
) -> Tensor:
    """Route each token [T, H] to its ``top_k`` experts (``moe_routing``), run ``expert(e, x)`` on
    the rows x [n, H] of each expert e that has any (gathered with index ops), and sum the results
    weighted by the routing weights in fp32, rounded once to the input dtype at the end.

    Instead of ``expert``, ``all_experts(rows, counts)`` may compute every expert in one call:
    rows [top_k * T, H] grouped by expert, counts[e] of them for expert e, results in that order."""
    if (expert is None) == (all_experts is None):
        raise ValueError("grouped_experts needs one of expert and all_experts")
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    weights, ids = moe_routing(router_logits, top_k, renormalize)
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # the (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=router_logits.shape[-1]).tolist()
    tokens = order // top_k
    rows = hidden.index_select(0, tokens)  # every pair's input, in expert order
    if all_experts is not None:
        results = all_experts(rows, counts)
    else:
        per_expert = []
        start = 0
        for e, count in enumerate(counts):
            if count:
                per_expert.append(expert(e, rows[start : start + count]))
                start += count
        results = torch.cat(per_expert)
    weighted = results.float() * weights.flatten()[order, None]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, tokens, weighted).to(hidden.dtype)


def _fused_moe(
    hidden: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, renormalize: bool
) -> Tensor:
    """A sparse mixture of gated SiLU experts: each token [T, H] goes to the ``top_k`` experts its
    router logits [T, E] pick (``moe_routing``), expert e computes
    ``w2[e] @ (silu(gate) * up)`` with ``(gate, up) = w13[e] @ x`` (w13 [E, 2I, H] holds gate then
    up, w2 is [E, H, I]), and the outputs are summed weighted by the routing weights, in fp32.

    Grouped by expert, as transformers computes it (``grouped_experts``): each product rounds to
    the input dtype, the weighted sum is fp32, rounded once at the end.
    """
    check_fused_moe_shapes(hidden, router_logits, w13, w2, top_k)

    def expert(e: int, x: Tensor) -> Tensor:
        act = _silu_and_mul(torch.nn.functional.linear(x, w13[e]))
        return torch.nn.functional.linear(act, w2[e])

    return grouped_experts(hidden, router_logits, top_k, renormalize, expert)


fused_moe = custom_op("kvik::fused_moe", _fused_moe, mutates_args=())


@fused_moe.register_fake
def _(hidden, router_logits, w13, w2, top_k, renormalize) -> Tensor:
    return torch.empty_like(hidden)


@custom_op("kvik::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Write key/value [T, Hk, D] into kv_cache [2, num_blocks, block_size, Hk, D] at slots [T].

    A slot is block_id * block_size + offset; a negative slot (padding) is skipped. An FP8 cache
    stores key / k_scale and value / v_scale (kvik.attention.kv_quant), so it needs both scales.
    """
    from kvik.attention.kv_quant import write_slots

    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    write_slots(flat[0], slot_mapping, key, k_scale)
    write_slots(flat[1], slot_mapping, value, v_scale)


@reshape_and_cache.register_fake
def _(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    return None


@custom_op("kvik::unified_attention", mutates_args=("output",))
def unified_attention(
    query: Tensor, key: Tensor, value: Tensor, output: Tensor, layer_name: str
) -> None:
    """The one seam between models and attention backends (and where piecewise compilation splits).

    query [T, H*D], key/value [T, Hk*D]; the result goes to output [T, H*D]. The layer, its KV cache
    and the step's metadata come from the forward context (kvik.worker.forward_context).
    """
    from kvik.worker.forward_context import get_forward_context

    context = get_forward_context()
    layer = context.attention_layers[layer_name]
    layer.impl.forward(query, key, value, layer.kv_cache, context.attn_metadata, output)


@unified_attention.register_fake
def _(query, key, value, output, layer_name) -> None:
    return None


@custom_op("kvik::unified_attention_with_rotary", mutates_args=("output",))
def unified_attention_with_rotary(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    head_size: int,
    is_neox: bool,
    output: Tensor,
    layer_name: str,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    norm_eps: float = 0.0,
) -> None:
    """``unified_attention`` of query and key rotated at ``positions`` (the rotary's arguments as
    ``rotary_embedding`` takes them), for backends that rotate while they write the KV cache
    (``AttentionImpl.fuses_rotary``): compiled code then launches one kernel where it would launch
    the rotation and the cache write apart. With ``q_norm_weight`` and ``k_norm_weight`` (for
    backends with ``fuses_head_norms``), each head is RMS-normalised first."""
    from kvik.layers.rotary import HeadNorms, Rotation
    from kvik.worker.forward_context import get_forward_context

    context = get_forward_context()
    layer = context.attention_layers[layer_name]
    rotation = Rotation(head_size, cos_sin_cache, is_neox)
    head_norms = None
    if q_norm_weight is not None and k_norm_weight is not None:
        head_norms = HeadNorms(q_norm_weight, k_norm_weight, norm_eps)
    layer.impl.forward_with_rotary(
        positions, rotation, query, key, value, layer.kv_cache, context.attn_metadata, output,
        head_norms,
    )  # fmt: skip


@unified_attention_with_rotary.register_fake
def _(
    query, key, value, positions, cos_sin_cache, head_size, is_neox, output, layer_name,
    q_norm_weight=None, k_norm_weight=None, norm_eps=0.0,
) -> None:  # fmt: skip
    return None


def _eagle3_indices(
    sample_index: Tensor,
    base_rows: Tensor,
    prompt_next: Tensor,
    table_rows: Tensor,
    num_blocks: Tensor,
    num_accepted: Tensor | None,
    verified_tokens: Tensor | None,
    input_ids: Tensor,
    positions: Tensor,
    block_table: Tensor,
    last_rows: Tensor,
    next_ids: Tensor,
    rows: Tensor,
    pass_tokens: Tensor,
    draft_positions: Tensor,
    draft_slots: Tensor,
    draft_seq_lens: Tensor,
    draft_block_table: Tensor,
    block_size: int,
    max_model_len: int,
) -> None:
    """The indices of an EAGLE-3 proposal (kvik.spec_decode.eagle3_proposer), all on the device.

    Per scheduled request i: its last row whose next token is known, ``last_rows[i]`` (its base
    row, moved on by the drafts it accepted where it samples: ``sample_index[i] >= 0`` is its row
    in ``num_accepted`` and ``verified_tokens``), and that token, ``next_ids[i]`` (the one sampled
    there, or the prompt's next token ``prompt_next[i]``). The batched pass's tokens
    ``pass_tokens`` [T]: row p holds the step's token at p + 1 (the last row 0), and each request's
    last known row its next token. Per proposing request j (then padding): its last known row
    ``rows[j]`` (``last_rows[table_rows[j]]``), and for each draft step s (the views' first dim)
    the position after that row's plus s (at most ``max_model_len - 1``), its KV slot (-1 past the
    request's ``num_blocks[j]`` blocks), its sequence length, and the request's block-table row
    ``block_table[table_rows[j]]`` (the view's columns)."""
    n = pass_tokens.shape[0]
    pass_tokens[: n - 1] = input_ids[1:n]
    pass_tokens[n - 1 :] = 0
    if num_accepted is None or verified_tokens is None:
        last_rows.copy_(base_rows)
        next_ids.copy_(prompt_next)
    else:
        samples = sample_index >= 0
        index = sample_index.clamp(min=0)
        accepted = torch.where(samples, num_accepted.index_select(0, index), 0)
        torch.add(base_rows, accepted, out=last_rows)
        torch.where(samples, verified_tokens[index, accepted], prompt_next, out=next_ids)
    pass_tokens[last_rows] = next_ids
    rows.copy_(last_rows.index_select(0, table_rows))
    steps = draft_positions.shape[0]
    if steps == 0 or rows.numel() == 0:
        return
    offsets = torch.arange(1, steps + 1, device=positions.device)
    drafted = positions.index_select(0, rows)[None, :] + offsets[:, None]
    drafted = drafted.clamp_(max=max_model_len - 1)  # [steps, rows]
    table = block_table.index_select(0, table_rows)
    draft_block_table.copy_(table[:, : draft_block_table.shape[1]])
    block = torch.div(drafted, block_size, rounding_mode="floor")
    column = torch.minimum(block, (num_blocks - 1).clamp(min=0)[None, :])
    slots = table.gather(1, column.T).T.to(torch.int64) * block_size + drafted % block_size
    draft_slots.copy_(torch.where(block < num_blocks[None, :], slots, -1))
    draft_positions.copy_(drafted)
    draft_seq_lens.copy_(drafted + 1)


eagle3_indices = custom_op(
    "kvik::eagle3_indices",
    _eagle3_indices,
    mutates_args=(
        "last_rows", "next_ids", "rows", "pass_tokens", "draft_positions", "draft_slots",
        "draft_seq_lens", "draft_block_table",
    ),
)  # fmt: skip


@eagle3_indices.register_fake
def _(*args, **kwargs) -> None:
    return None


#: Each small op's reference, for ``small_op`` under the "direct" dispatch.
_REFERENCES: dict[str, Callable] = {
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "rotary_embedding": _rotary_embedding,
    "silu_and_mul": _silu_and_mul,
    "fused_moe": _fused_moe,
    "argmax_rows": _argmax_rows,
    "embed_rms_norm_cat": _embed_rms_norm_cat,
    "eagle3_indices": _eagle3_indices,
}
