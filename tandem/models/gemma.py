"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text (`Gemma3ForCausalLM`, model_type
gemma3_text), as transformers defines them:

- the embedding output scaled by sqrt(hidden_size), the scale rounded to the model's dtype;
- Gemma's RMSNorm (`x * (1 + weight)`, in float32), four per layer: input, post-attention
  (on the attention's output, before the residual add), pre-feedforward and
  post-feedforward (on the MLP's output); the residual adds fused into the next norm as
  in the base layer;
- a GELU(tanh)-gated MLP (`hidden_activation: gelu_pytorch_tanh`);
- attention scaled by `query_pre_attn_scalar ** -0.5`, soft-capped by
  `attn_logit_softcapping` when set (Gemma 2), a sliding window of `sliding_window` keys on
  the layers `layer_types` calls "sliding_attention" (Gemma 2: the even layers; Gemma 3:
  five of every six), the others global;
- Gemma 3: per-head q/k norms (Gemma's RMSNorm) before RoPE, and two RoPE tables: the
  sliding layers' (`rope_parameters["sliding_attention"]`, base `rope_local_base_freq`) and
  the global layers' (`rope_parameters["full_attention"]`, with its scaling);
- the final logits soft-capped by `final_logit_softcapping` when set (`LogitsProcessor`);
- tied embeddings by default.

The C++ fused decode layer does not compute this layer: `prepare_fused_decode` leaves it off.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.layernorm import GemmaRMSNorm
from tandem.layers.logits_processor import LogitsProcessor
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.models.base import (
    Attention,
    CausalLM,
    GatedMLP,
    LayerOptions,
    head_dim_of,
    make_rotary_embedding,
    rope_settings,
)

GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def gemma_layer_options(config, layer_id: int, qk_norm: bool) -> LayerOptions:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"Gemma hidden_activation {act!r} is not supported; supported: {sorted(GEMMA_ACTIVATIONS)}")
    types = getattr(config, "layer_types", None)
    sliding = types[layer_id] == "sliding_attention" if types else layer_id % 2 == 0
    window = getattr(config, "sliding_window", None) or 0
    scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim_of(config)
    return LayerOptions(
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        qk_norm=qk_norm,
        activation=GEMMA_ACTIVATIONS[act],
        sliding_window=int(window) if sliding else 0,
        attn_logit_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        attn_scale=float(scalar) ** -0.5,
    )


class GemmaAttention(Attention):
    """The base attention with Gemma's RMSNorm as the q/k norm (Gemma 3)."""

    def __init__(self, config, layer_id, tp_rank, tp_size, rotary_emb, options):
        super().__init__(config, layer_id, tp_rank, tp_size, rotary_emb, options)
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """input norm, attention, post-attention norm, (+ residual) pre-feedforward norm, MLP,
    post-feedforward norm; the residual add into the next layer's input norm."""

    def __init__(self, config, layer_id, tp_rank, tp_size, rotary_emb, options: LayerOptions):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_id, tp_rank, tp_size, rotary_emb, options)
        self.mlp = GatedMLP(hidden, config.intermediate_size, tp_rank, tp_size, options.activation)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.fused_decode = None

    def prepare_fused_decode(self) -> None:
        """The C++ fused decode layer computes Llama's layer, not this one."""
        self.fused_decode = None

    def forward(self, cos_sin, hidden, residual, fb, ctx):
        if residual is None:
            hidden, residual = self.input_layernorm.forward(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(cos_sin, hidden, fb, ctx)
        hidden = self.post_attention_layernorm.forward(hidden)
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        hidden = self.post_feedforward_layernorm.forward(self.mlp.forward(hidden, ctx.lora))
        return hidden, residual


def _rope_of(config, params: dict, default_theta: float) -> RotaryEmbedding:
    kind = params.get("rope_type", params.get("type", "default"))
    head_dim = head_dim_of(config)
    return RotaryEmbedding(
        head_dim,
        head_dim,
        config.max_position_embeddings,
        float(params.get("rope_theta", default_theta)),
        dict(params) if kind not in (None, "default") else None,
    )


class GemmaModel(nn.Module):
    """Scaled embedding, the layers, final norm; a sliding layer rotates by `rotary_emb_local`
    when the family has one (Gemma 3), else every layer by `rotary_emb`."""

    def __init__(self, config, tp_rank, tp_size, layer_options, local_rope: bool):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.rotary_emb, self.rotary_emb_local = self._rotary_embeddings(config, local_rope)
        options = [layer_options(config, i) for i in range(config.num_hidden_layers)]
        self.local = [bool(o.sliding_window) and self.rotary_emb_local is not None for o in options]
        self.layers = nn.ModuleList(
            [
                GemmaDecoderLayer(
                    config, i, tp_rank, tp_size, self.rotary_emb_local if local else self.rotary_emb, options[i]
                )
                for i, local in enumerate(self.local)
            ]
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def _rotary_embeddings(config, local_rope: bool):
        if not local_rope:
            return make_rotary_embedding(config), None
        params = getattr(config, "rope_parameters", None) or {}
        if "full_attention" in params or "sliding_attention" in params:  # transformers 5's per-layer-type form
            full = _rope_of(config, params.get("full_attention") or {}, 1_000_000.0)
            local = _rope_of(config, params.get("sliding_attention") or {}, 10_000.0)
            return full, local
        theta, scaling = rope_settings(config)
        local_theta = float(getattr(config, "rope_local_base_freq", None) or 10_000.0)
        full = _rope_of(config, {**(scaling or {}), "rope_theta": theta}, theta)
        return full, _rope_of(config, {"rope_theta": local_theta}, local_theta)

    def forward(self, input_ids, positions, fb, ctx):
        hidden = self.embed_tokens.forward(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        cos_sin = self.rotary_emb.lookup(positions)
        cos_sin_local = self.rotary_emb_local.lookup(positions) if self.rotary_emb_local is not None else None
        residual = None
        for layer, local in zip(self.layers, self.local):
            hidden, residual = layer.forward(cos_sin_local if local else cos_sin, hidden, residual, fb, ctx)
        return self.norm.forward(hidden, residual)[0]


class Gemma2ForCausalLM(CausalLM):
    local_rope = False  # one RoPE table for every layer
    qk_norm = False

    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return gemma_layer_options(config, layer_id, qk_norm=cls.qk_norm)

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        # CausalLM's attributes, with Gemma's decoder model (CausalLM.__init__ builds Llama's).
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaModel(config, tp_rank, tp_size, self.layer_options, self.local_rope)
        self.logits_processor = LogitsProcessor(getattr(config, "final_logit_softcapping", None))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    local_rope = True  # sliding layers rotate with rope_local_base_freq
    qk_norm = True


EntryClass = [Gemma2ForCausalLM, Gemma3ForCausalLM]
