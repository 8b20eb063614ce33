"""The pre-norm decoder of the mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE):
Llama's layers with a sparse MoE block where the MLP was, on some or all layers.

Each model says how its layers differ (``MoeForCausalLM``'s class attributes and ``moe_spec``):
its attention, which layers are sparse, the experts' sizes and routing, and whether a shared
expert runs beside them (Qwen2-MoE). Expert weights load from per-expert or stacked checkpoints
(kvik.layers.moe).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from kvik.config import ModelConfig
from kvik.distributed.parallel_state import get_tp_group
from kvik.layers.activation import SiluAndMul
from kvik.layers.embedding import LMHead, VocabEmbedding
from kvik.layers.linear import Linear, MergedColumnLinear
from kvik.layers.moe import FusedMoE, expert_shard, is_stacked_expert_param
from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import RotaryEmbedding, get_rope, rope_config
from kvik_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_size

if TYPE_CHECKING:
    from kvik.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class MoeSpec:
    """A model's sparse blocks, read from its config."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    #: The shared expert's intermediate size (Qwen2-MoE), or 0 for none.
    shared_intermediate_size: int = 0


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), checkpoint names gate_proj, up_proj, down_proj."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            hidden_size,
            [intermediate_size] * 2,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, hidden]

    def activation_links(self) -> list[tuple[nn.Module, nn.Module]]:
        """SiLU-and-mul may write down's quantized input (kvik.quantization.activation)."""
        return [(self.act_fn, self.down_proj)]


class SparseMoeBlock(nn.Module):
    """A router (``gate``: hidden -> one logit per expert) and the experts; Qwen2-MoE's shared
    expert is added, scaled by the sigmoid of its own one-logit gate."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoeSpec,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # The routers stay unquantized, as in the FP8 releases (and vLLM's models): their few
        # outputs decide the routing, and rounding them would move tokens between experts.
        self.gate = Linear(hidden_size, spec.num_experts, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden_size,
            spec.intermediate_size,
            spec.renormalize,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.shared_expert: GatedMLP | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden_size,
                spec.shared_intermediate_size,
                quant_config,
                prefix=f"{prefix}.shared_expert",
            )
            self.shared_expert_gate = Linear(hidden_size, 1, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: Tensor) -> Tensor:
        out = self.experts(x, self.gate(x))  # [T, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer (its forward: the residual add fused into the next norm) over the
    attention and the MoE block it is given."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer's builds a dense MLP
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoeModel(nn.Module):
    def __init__(
        self,
        config: Any,
        owner: type[MoeForCausalLM],
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
    ) -> None:
        super().__init__()
        d, base, scaling = head_size(config), *rope_config(config)
        rotary_emb: RotaryEmbedding = get_rope(d, d, config.max_position_embeddings, base, scaling)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        spec = owner.moe_spec(config)
        attention_cls = owner.attention_class(config)
        layers = []
        for i in range(config.num_hidden_layers):
            layer_prefix = f"{prefix}.layers.{i}"
            if owner.is_sparse_layer(config, i):
                mlp: nn.Module = SparseMoeBlock(
                    config.hidden_size, spec, quant_config, prefix=f"{layer_prefix}.mlp"
                )
            else:
                mlp = GatedMLP(
                    config.hidden_size,
                    config.intermediate_size,
                    quant_config,
                    prefix=f"{layer_prefix}.mlp",
                )
            attention = attention_cls(
                config, i, rotary_emb, quant_config, prefix=f"{layer_prefix}.self_attn"
            )
            layers.append(MoeDecoderLayer(config, attention, mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's causal LM over ``MoeModel``; subclasses say how their config reads."""

    #: Checkpoint name fragments renamed before anything else (Mixtral's "block_sparse_moe").
    renamed_modules: ClassVar[dict[str, str]] = {}

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)  # not Llama's: its model would build dense MLPs on every layer
        tp_size = get_tp_group().world_size
        if tp_size > 1:
            raise ValueError(
                f"{type(self).__name__} does not run under tensor parallelism yet (asked for "
                f"{tp_size} ranks): its experts are not split between ranks; use "
                "--tensor-parallel-size 1"
            )
        hf = config.hf_config
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.model = MoeModel(hf, type(self), config.quant_config, prefix="model")
        self.lm_head = LMHead(hf.vocab_size, hf.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        """The sparse blocks' sizes and routing, as this architecture's config names them."""
        raise NotImplementedError(f"{cls.__name__} must say how its config reads (moe_spec)")

    @classmethod
    def attention_class(cls, config: Any) -> type[LlamaAttention]:
        return cls.attention_cls

    @classmethod
    def is_sparse_layer(cls, config: Any, layer_idx: int) -> bool:
        """Qwen's rule, which every layer of Mixtral and OLMoE meets (their configs have neither
        ``mlp_only_layers`` nor ``decoder_sparse_step``)."""
        return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (
            (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """As Llama's, and every expert's tensors are there: a stacked parameter loads whole or
        from all its experts' shards."""
        shards: dict[str, set[Any]] = {}

        def noted(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights:
                target, shard_id = self._packed_name(name)
                if is_stacked_expert_param(target):
                    shards.setdefault(target, set()).add(shard_id)
                yield name, tensor

        super().load_weights(noted(weights))
        for name, module in self.named_modules():
            if not isinstance(module, FusedMoE):
                continue
            experts = range(module.num_experts)
            halves = {(e, half) for e in experts for half in ("gate", "up")}
            # Every stacked parameter of the layer's method (weights, and block scales in FP8).
            expected = {
                f"{name}.{param}": halves if param.startswith("gate_up_proj") else set(experts)
                for param, _ in module.named_parameters(recurse=False)
            }
            for target, wanted in expected.items():
                got = shards.get(target, set())
                if None not in got and (missing := wanted - got):
                    raise ValueError(
                        f"checkpoint has no weights for {target} of experts "
                        f"{sorted({m[0] if isinstance(m, tuple) else m for m in missing})}"
                    )

    def decoder_stack(self) -> None:
        """No ``DecoderStack``: its declared layers have a dense MLP."""
        return None

    def _packed_name(self, name: str) -> tuple[str, Any]:
        for old, new in self.renamed_modules.items():
            name = name.replace(old, new)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return name, None  # already stacked: [E, 2I, H] or [E, H, I]
        if (shard := expert_shard(name)) is not None:
            return shard
        return super()._packed_name(name)
