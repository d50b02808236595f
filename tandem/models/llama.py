"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over Tandem's KV pool.

One implementation covers the family; the differences are read from the config:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, GQA, head_dim,
RoPE scaling. The forward takes the `ForwardBatch` explicitly: no global state.

Submodules are run by calling their `forward` directly, not through `nn.Module.__call__`:
its hook bookkeeping costs about 1-3 us a call on CPU, and a decode step makes ~10 such
calls per layer, a measurable share of a small model's step (Tandem registers no hooks).

Under tensor parallelism each rank holds its share of the attention heads (KV heads
replicated when there are fewer than ranks: `layers/linear.py`, `HeadSplit`), of the
MLP's intermediate size and of the vocabulary; the norms are replicated. Every rank
ends with the same full logits.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

import torch
from torch import nn

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.activation import SiluAndMul
from tandem.layers.attention.base import AttentionBackend
from tandem.layers.layernorm import RMSNorm
from tandem.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from tandem.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.quantization.gguf_linear import QUANT_MAX_ROWS
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.weight_shard import CheckpointTensor, read_whole
from tandem.sglang_flags import QUANTIZE_AT_LOAD
from tandem.mem_cache.memory_pool import TokenToKVPool
from tandem.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def rope_settings(config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either the old (`rope_theta`/`rope_scaling`) or
    the transformers 5 (`rope_parameters`) form of a config."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None) or params
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return float(theta), (dict(scaling) if kind not in (None, "default") else None)


class ModelContext:
    """What layers need besides their weights: where the KV lives and how to attend."""

    def __init__(self, kv_pool: TokenToKVPool, attn_backend: AttentionBackend):
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def make_rotary_embedding(config) -> RotaryEmbedding:
    """The model's one rotary embedding: every layer rotates by the same table (as
    SGLang's `get_rope` cache shares one), looked up once per forward."""
    theta, scaling = rope_settings(config)
    head_dim = head_dim_of(config)
    return RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, theta, scaling,
                           freq_factors=getattr(config, "rope_freq_factors", None))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp_rank: int, tp_size: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias, tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, False, tp_rank, tp_size)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb

    def forward(self, cos_sin: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                ctx: ModelContext):
        """`cos_sin`: the batch's tokens' rotation, `RotaryEmbedding.lookup(positions)`."""
        qkv = self.qkv_proj.forward(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self.rotary_emb.rotate(self.q_norm.forward(q), cos_sin)
            k = self.rotary_emb.rotate(self.k_norm.forward(k), cos_sin)
        else:  # query and key heads rotated in one call, in place in the QKV output
            q, k = self.rotary_emb.rotate(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        ctx.kv_pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        out = ctx.attn_backend.forward(q, self.layer_id, fb, self.scaling, self.num_heads,
                                       self.num_kv_heads, self.head_dim)
        return self.o_proj.forward(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], False, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp_rank, tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp_rank: int, tp_size: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp_rank, tp_size, rotary_emb)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = None  # set by prepare_fused_decode once the weights are loaded

    def prepare_fused_decode(self) -> None:
        """`fused_decode`: the weights `tandem_cpu.decode_layer` takes, when it can run this
        layer (one tensor-parallel rank, every linear quantized, no per-head q/k norm, the
        C++ kernels built), else None."""
        self.fused_decode = None
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ops = cpu_kernels.load()
        if (ops is None or attn.qkv_proj.tp_size != 1 or attn.qk_norm or any(m.quant_kernel is None for m in linears)
                or self.input_layernorm.eps != self.post_attention_layernorm.eps):
            return
        weights = [[k.q, k.scale, k.mn] + ([k.bias] if k.bias is not None else []) for k in (m.quant_kernel for m in linears)]
        formats = [v for m in linears for v in (m.quant_kernel.bits, m.quant_kernel.group)]
        self.fused_decode = (ops.decode_layer, weights, formats)

    def forward_fused(self, cos_sin, hidden, residual, fb, ctx, tables):
        """`forward` of a decode batch in one C++ call (`prepare_fused_decode`; the same
        kernels in the same order, so the same result)."""
        op, weights, formats = self.fused_decode
        attn, layer_id = self.self_attn, self.self_attn.layer_id
        return op(hidden, residual, self.input_layernorm.weight, self.post_attention_layernorm.weight,
                  self.input_layernorm.eps, *weights, formats, cos_sin, ctx.kv_pool.k_buffer[layer_id],
                  ctx.kv_pool.v_buffer[layer_id], fb.out_cache_loc, *tables, attn.scaling, attn.num_heads,
                  attn.num_kv_heads)

    def forward(self, cos_sin, hidden, residual, fb, ctx):
        """(MLP output, residual): the residual adds happen in the next norm's call
        (SGLang's layout); `residual` is None for the first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm.forward(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(cos_sin, hidden, fb, ctx)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.rotary_emb = make_rotary_embedding(config)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, tp_rank, tp_size, self.rotary_emb) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, fb, ctx):
        hidden, residual = self.embed_tokens.forward(input_ids), None
        cos_sin = self.rotary_emb.lookup(positions)
        tables = self._fused_decode_tables(hidden, cos_sin, fb, ctx)
        for layer in self.layers:
            if tables is not None and layer.fused_decode is not None:
                hidden, residual = layer.forward_fused(cos_sin, hidden, residual, fb, ctx, tables)
            else:
                hidden, residual = layer.forward(cos_sin, hidden, residual, fb, ctx)
        return self.norm.forward(hidden, residual)[0]

    @staticmethod
    def _fused_decode_tables(hidden, cos_sin, fb, ctx):
        """The attention tables for `LlamaDecoderLayer.forward_fused` when this forward may run
        its layers so: a plain decode on the C++ CPU kernels, of rows few enough for the
        quantized matmuls (`QUANT_MAX_ROWS`), the pool, rotation and activations in one dtype."""
        if fb.batch_size > QUANT_MAX_ROWS or hidden.dim() != 2 or fb.out_cache_loc.dtype != torch.int64:
            return None
        if not (hidden.dtype == cos_sin.dtype == ctx.kv_pool.dtype) or not hidden.is_cpu:
            return None
        return ctx.attn_backend.cpu_decode_tables(fb)


class LlamaForCausalLM(nn.Module):
    """Returns each request's next-token logits (float32), and prompt logprobs on request."""

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp_rank, tp_size)
        self.logits_processor = LogitsProcessor()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if self.tie_word_embeddings:
            # One parameter under two names; the checkpoint's lm_head.weight (if any) is skipped.
            self.lm_head.weight = self.model.embed_tokens.weight

    def process_weights_after_loading(self, linear_backend: str, quantization: str | None = None) -> None:
        """Choose every linear layer's matmul kernel (`--linear-backend`) once loaded;
        `--quantization` q8_0/q4_0/q4_1 quantizes each one's weight first, the LM head's
        too (a tied head's quantized weight is then also the embedding's)."""
        at_load = quantization if quantization in QUANTIZE_AT_LOAD else None
        dequantized: set[str] = set()
        linears = [(name, m) for name, m in self.named_modules() if isinstance(m, LinearBase)]
        for _, module in linears:
            # A tied head shares its weight with the embedding lookup: keep it.
            keep = module is self.lm_head and self.tie_word_embeddings
            module.process_weights_after_loading(linear_backend, keep_weight=keep, quantization=at_load)
            dequantized |= module.dequantized_types - {"F32", "F16", "BF16"}
        for layer in self.model.layers:
            layer.prepare_fused_decode()
        self.model.embed_tokens.finish_loading(shared_with_head=self.tie_word_embeddings)
        if dequantized and linear_backend == "auto":
            logger.info("GGUF tensors of type %s run dequantized (no quantized CPU kernel for them here)",
                        ", ".join(sorted(dequantized)))
        if at_load:
            done = [m for _, m in linears if m.quantized_at_load]
            dense = sorted({re.sub(r"\.\d+\.", ".*.", name) for name, m in linears if not m.quantized_at_load})
            logger.info("--quantization %s: %d of %d linear layers quantized (%d on the quantized kernel)%s",
                        at_load, len(done), len(linears), sum(m.quant_kernel is not None for m in done),
                        f"; dense (input width not a multiple of 32): {', '.join(dense)}" if dense else "")

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, ctx: ModelContext) -> LogitsProcessorOutput:
        hidden = self.model.forward(fb.input_ids, fb.positions, fb, ctx)
        return self.logits_processor(hidden, self.lm_head.forward, fb)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]], require_all: bool = True) -> None:
        """Copy each checkpoint tensor's part that this rank owns into its parameter;
        ValueError for an unknown name or, with `require_all`, a parameter left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue
            if self.tie_word_embeddings and name == "model.embed_tokens.weight":  # the head's GGUF blocks too
                self.lm_head.keep_shard_blocks(tensor)
            for ckpt_part, param_part, shard_id in self.stacked_params:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, param_part)
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight in checkpoint: {name}")
                param = params[name]
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    loader(param, tensor)
                else:
                    param.data.copy_(read_whole(tensor))
                loaded.add(name)
        missing = set(params) - loaded
        if missing and require_all:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass
