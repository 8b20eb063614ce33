"""An EAGLE-3 draft head in the layout of the public EAGLE-3 checkpoints.

A head is one Llama decoder layer (``midlayer``) whose attention reads ``2 * hidden`` features: the
normed embedding of the next token beside the normed target hidden state. The target hidden state
is ``fc`` applied to the target's hidden states from three layers (``3 * target_hidden``). After the
layer, ``norm`` and ``lm_head`` give logits over a reduced draft vocabulary; ``d2t`` maps a draft id
to its target id (``target = draft + d2t[draft]``) and ``t2d`` marks the target ids the draft vocab
holds. The head has no embedding of its own unless the checkpoint carries ``embed_tokens.weight``:
it shares the target's.

Row convention (the one the trainer, the offline evaluation and the runner share): row ``p`` of a
draft pass has position ``p`` and is fed the token at ``p + 1`` with the target's hidden state at
``p``; it predicts the token at ``p + 2``. The next draft step appends a row at ``p + 1`` fed with
the drafted token and this row's pre-norm output as its hidden state.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from kvik.layers.rotary import inv_freq

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """The target layers whose inputs feed the head: early, middle and late, as vLLM picks them
    for Llama when a checkpoint does not name its own (hidden_states[i] of transformers is the
    input to layer i)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    #: True: the residual stream starts from the normed hidden state (the "speculators" layout).
    norm_before_residual: bool = False
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    architectures: list[str] = field(default_factory=lambda: [ARCHITECTURE])

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"EAGLE-3 heads use silu; got hidden_act {self.hidden_act!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        """From a head's config.json; keys this head does not use (torch_dtype, model_type, ...)
        are ignored, a missing required key is an error that names it."""
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in raw.items() if k in known}
        if "rope_parameters" in raw and "rope_theta" not in raw:  # transformers 5's spelling
            params = dict(raw["rope_parameters"])
            values["rope_theta"] = params.pop("rope_theta", 10000.0)
            if params.get("rope_type", "default") != "default":
                values["rope_scaling"] = params
        if raw.get("draft_vocab_size") is None:
            values["draft_vocab_size"] = raw.get("vocab_size")
        required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [k for k in required if values.get(k) is None]
        if missing:
            raise ValueError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        return cls(**values)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Neox style (halves), as Llama checkpoints in transformers' layout use.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        freq = inv_freq(d, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        self.register_buffer("inv_freq", freq, persistent=False)

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H], positions [T] -> q [B, heads, T, D], k and v [B, heads, T, D] (the kv
        heads repeated to the query heads), rotated."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    @staticmethod
    def merge_heads(attended: Tensor) -> Tensor:
        """[B, heads, T, D] -> [B, T, heads * D]."""
        b, _, t, _ = attended.shape
        return attended.transpose(1, 2).reshape(b, t, -1)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The ``midlayer``: split into its steps so that a trainer can attend over rows of several
    draft steps at once (``attention_inputs`` for every step, then ``finish`` per step)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """-> the attention's input ``[..., 2 * hidden]`` and the residual stream's start."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1), residual

    def attention_inputs(
        self, embeds: Tensor, hidden: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> q, k, v and the residual stream's start."""
        x, residual = self.attention_input(embeds, hidden)
        q, k, v = self.self_attn.project(x, positions)
        return q, k, v, residual

    def finish(self, attended: Tensor, residual: Tensor) -> Tensor:
        """Attention output [B, heads, T, D] -> the layer's output before the final norm."""
        return self.after_attention(self.self_attn.merge_heads(attended), residual)

    def after_attention(self, attended: Tensor, residual: Tensor) -> Tensor:
        """Attention output with its heads merged [..., heads * D] -> the layer's output before
        the final norm."""
        residual = self.self_attn.o_proj(attended) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding | None = None) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        # Shared with the target unless the checkpoint has its own; not a submodule then, so that
        # it is neither saved nor trained with the head.
        self._embed = [embed_tokens]
        self.embed_tokens: nn.Embedding | None = None

    def set_vocab_map(self, draft_to_target_ids: Tensor) -> None:
        """Draft id i stands for target id ``draft_to_target_ids[i]`` (sorted, distinct)."""
        ids = draft_to_target_ids.to(torch.int64)
        if ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"need {self.config.draft_vocab_size} target ids, got {ids.shape}")
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft_to_target_ids repeats a target id")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embedding(self) -> nn.Module:
        """The token embedding the head reads: its own, else the target's it was given."""
        embedding = self.embed_tokens if self.embed_tokens is not None else self._embed[0]
        if embedding is None:
            raise ValueError(
                "this EAGLE-3 head has no embed_tokens of its own: pass the target's embedding"
            )
        return embedding

    def embed(self, token_ids: Tensor) -> Tensor:
        return self.embedding()(token_ids).to(self.fc.weight.dtype)

    def combine(self, aux_hidden: Tensor) -> Tensor:
        """The target's hidden states of three layers, concatenated [..., 3 * target_hidden] ->
        the head's hidden input [..., hidden]."""
        return self.fc(aux_hidden)

    def forward(
        self, token_ids: Tensor, hidden: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Causal pass over rows [B, T]: (draft logits [B, T, draft_vocab], pre-norm outputs
        [B, T, hidden], the hidden input of a following draft step)."""
        prenorm = self._prenorm(token_ids, hidden, positions)
        return self.lm_head(self.norm(prenorm)), prenorm

    def _prenorm(self, token_ids: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        q, k, v, residual = self.midlayer.attention_inputs(self.embed(token_ids), hidden, positions)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.midlayer.finish(attended, residual)

    @torch.no_grad()
    def propose_greedy(self, token_ids: Tensor, hidden: Tensor, k: int) -> Tensor:
        """k greedy draft tokens (target ids) following one sequence: token_ids [T] and hidden
        [T, hidden] in the row convention (the last row holds the newest token). Recomputes the
        causal pass over all rows each step, which is exact and cheap for one layer offline (the
        runner's proposer, kvik.spec_decode.eagle3_proposer, keeps a KV cache instead; this is
        its reference in the tests)."""
        tokens, states = token_ids.unsqueeze(0), hidden.unsqueeze(0)
        drafted = []
        for _ in range(k):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            prenorm = self._prenorm(tokens, states, positions)
            # Only the newest row's logits are read: the LM head runs on it alone.
            logits = self.lm_head(self.norm(prenorm[0, -1]))
            draft = self.draft_to_target(logits.argmax())
            drafted.append(draft)
            tokens = torch.cat([tokens, draft.view(1, 1)], dim=1)
            states = torch.cat([states, prenorm[:, -1:]], dim=1)
        return torch.stack(drafted)


def save_eagle3_head(head: Eagle3Head, folder: str | Path) -> None:
    """config.json and model.safetensors in the public checkpoints' names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {**asdict(head.config), "model_type": "llama", "num_hidden_layers": 1}
    (folder / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE))


def load_eagle3_head(
    folder: str | Path,
    embed_tokens: nn.Embedding | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Eagle3Head:
    """A head from a folder holding config.json and *.safetensors (public heads or the trainer's).

    ``embed_tokens``: the target's embedding, used when the checkpoint has none of its own."""
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} holds no {CONFIG_FILE}: not an EAGLE-3 head folder")
    config = Eagle3Config.from_dict(json.loads(config_path.read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    tensors: dict[str, Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    head = Eagle3Head(config, embed_tokens)
    own_embedding = tensors.pop("embed_tokens.weight", None)
    if "d2t" not in tensors:  # a head over the full vocabulary
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"{folder}: draft_vocab_size < vocab_size but no d2t map")
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        tensors["t2d"][torch.arange(config.draft_vocab_size) + tensors["d2t"]] = True
    expected = set(head.state_dict())
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise ValueError(
            f"{folder} is not in the EAGLE-3 layout: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    for name, tensor in tensors.items():
        shape = head.state_dict()[name].shape
        if tensor.shape != shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
    head.load_state_dict(tensors)
    if own_embedding is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(own_embedding, freeze=True)
    head = head.to(device=device, dtype=dtype)  # casts the floating-point tensors only
    # The rotary frequencies stay fp32: rounded to bf16, a position in the thousands would be
    # rotated by radians too much or too little.
    attention = head.midlayer.self_attn
    attention.inv_freq = attention.inv_freq.to(device=device, dtype=torch.float32)
    attention.inv_freq.copy_(
        inv_freq(config.head_dim, config.rope_theta, config.rope_scaling,
                 config.max_position_embeddings)
    )  # fmt: skip
    return head
