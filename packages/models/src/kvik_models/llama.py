"""Llama and the models that share its decoder: Mistral (sliding window) and Qwen2 (qkv bias).

Shaped like Hugging Face's modeling_llama.py, on kvik's flat token layout: a step's tokens of all
requests concatenated, ``input_ids [T]``, ``positions [T]``, hidden ``[T, hidden]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from kvik.config import ModelConfig
from kvik.layers.activation import SiluAndMul
from kvik.layers.attention import Attention
from kvik.layers.embedding import LMHead, VocabEmbedding
from kvik.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
    default_weight_loader,
)
from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import RotaryEmbedding, get_rope, rope_config
from kvik.quantization.activation import QuantizedActivation
from kvik.quantization.parameters import check_dtype

if TYPE_CHECKING:
    from kvik.models.decoder_stack import DecoderStack
    from kvik.quantization.base import QuantizationConfig


def head_size(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window(config: Any, layer_idx: int) -> int | None:
    """Hugging Face's rule: per layer where the config lists ``layer_types`` (Qwen2, Qwen3), else
    the config's ``sliding_window`` for every layer (Mistral). A window of 0 (some configs' way
    of saying none) is none: as a window it would hide every key from the CPU backend's mask."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    else:
        window = getattr(config, "sliding_window", None)
    return window or None


class LlamaAttention(nn.Module):
    #: Qwen2 has biases on q, k and v whatever its config says (it has no ``attention_bias``).
    qkv_bias: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        self.head_size = head_size(config)
        bias = getattr(config, "attention_bias", False)
        # Column-parallel: this rank's query heads and KV heads (kvik.layers.linear).
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            self.head_size,
            nh,
            nkv,
            bias or self.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            nh * self.head_size,
            config.hidden_size,
            bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.qkv_proj.num_kv_heads,
            layer_name=f"model.layers.{layer_idx}.self_attn.attn",
            sliding_window=sliding_window(config, layer_idx),
        )

    def qkv(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # [T, H*D], [T, Hk*D], [T, Hk*D]
        return self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        q, k, v = self.qkv(hidden)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))  # [T, hidden]

    def activation_links(self) -> list[tuple[nn.Module, nn.Module]]:
        """The attention layer may write o_proj's quantized input (kvik.quantization.activation)."""
        return [(self.attn, self.o_proj)]


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class LlamaMLP(nn.Module):
    def __init__(
        self, config: Any, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size,
            [size, size],
            bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor | QuantizedActivation) -> Tensor:
        if self.act_fn.quantize_output is not None and isinstance(x, QuantizedActivation):
            # Both ends quantized (kvik.quantization.activation): gate/up, SiLU-and-mul and
            # down's quantization may be one op of the kernel (one launch at few rows on a GPU).
            fused = self.gate_up_proj.silu_and_mul_quantized(x)
            if fused is not None:
                return self.down_proj(fused)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, hidden]

    def activation_links(self) -> list[tuple[nn.Module, nn.Module]]:
        """SiLU-and-mul may write down's quantized input (kvik.quantization.activation)."""
        return [(self.act_fn, self.down_proj)]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(
            config, layer_idx, rotary_emb, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        # The residual add is fused into the next norm: each layer hands on (hidden, residual).
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def activation_links(self) -> list[tuple[nn.Module, nn.Module]]:
        """The norms may write the quantized input of the projection each feeds
        (kvik.quantization.activation): q/k/v's, and gate/up's where the MLP is dense (a MoE
        block reads the norm's output twice, in its router and its experts)."""
        links = [(self.input_layernorm, self.self_attn.qkv_proj)]
        gate_up = getattr(self.mlp, "gate_up_proj", None)  # a dense MLP's
        if gate_up is not None:
            links.append((self.post_attention_layernorm, gate_up))
        return links


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        attention_cls: type[LlamaAttention],
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
    ) -> None:
        super().__init__()
        d, base, scaling = head_size(config), *rope_config(config)
        # One cos/sin table shared by every layer (a long context makes it large).
        rotary_emb = get_rope(d, d, config.max_position_embeddings, base, scaling)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, i, rotary_emb, attention_cls, quant_config, prefix=f"{prefix}.layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    #: checkpoint module -> (kvik's packed module, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        # Linear layers get their quantization method from the checkpoint's (or the option's)
        # config by their module names; the LM head stays unquantized.
        self.model = LlamaModel(hf, self.attention_cls, config.quant_config, prefix="model")
        self.lm_head = LMHead(hf.vocab_size, hf.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """[N, vocab]; with ``out``, written into that buffer and returned (``LMHead``)."""
        return self.lm_head(hidden, out)  # [N, vocab]

    def decoder_stack(self) -> DecoderStack | None:
        """The layers as ``kvik.models.decoder_stack`` declares them, for a platform's own decode."""
        from kvik_models.llama_stack import llama_decoder_stack

        return llama_decoder_stack(self)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: dict[str, set[int | str | None]] = {}  # parameter -> the shards written
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            target, shard_id = self._packed_name(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint weight {name!r} matches no parameter of {type(self).__name__}"
                )
            param = params[target]
            if shard_id in loaded.get(target, ()):
                # Two files of the checkpoint hold it: the last read would silently win.
                raise ValueError(f"checkpoint weight {name!r} is in the checkpoint twice")
            try:
                check_dtype(param, tensor)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {name!r}: {e}") from None
            loaded.setdefault(target, set()).add(shard_id)
        missing = sorted(params.keys() - loaded.keys())
        # A fused parameter written by some of its shards only (its other rows or scales would
        # stay uninitialised).
        for target, shards in sorted(loaded.items()):
            if None not in shards and (absent := self._shards_of(target) - shards):
                names = ", ".join(sorted(self._checkpoint_module(target, s) for s in absent))
                missing.append(f"{target} (from {names})")
        if missing:
            raise ValueError(f"checkpoint has no weights for {', '.join(missing)}")

    def _shards_of(self, param: str) -> set[int | str]:
        """The shard ids of the packed module ``param`` belongs to (empty if it is not packed)."""
        module = param.rsplit(".", 2)[-2] if "." in param else ""
        return {sid for packed, sid in self.packed_modules_mapping.values() if packed == module}

    def _checkpoint_module(self, param: str, shard_id: int | str) -> str:
        """The checkpoint module that holds shard ``shard_id`` of the packed ``param``."""
        parent, packed = param.rsplit(".", 2)[:2]
        module = next(
            module
            for module, (target, sid) in self.packed_modules_mapping.items()
            if (target, sid) == (packed, shard_id)
        )
        return f"{parent}.{module}"

    def _packed_name(self, name: str) -> tuple[str, int | str | None]:
        for module, (packed, shard_id) in self.packed_modules_mapping.items():
            if f".{module}." in name:
                return name.replace(f".{module}.", f".{packed}."), shard_id
        return name, None


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
