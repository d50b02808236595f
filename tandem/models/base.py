"""Building blocks of Tandem's decoder-only models over its KV pool: one family file
(`llama.py`, `qwen2.py`, ...) picks its per-layer options and inherits the rest.

- `LayerOptions`: what may differ between families, or between layers of one model (q/k/v
  bias, per-head q/k RMSNorm, the MLP's activation). A family says its options in
  `CausalLM.layer_options(config, layer_id)`; nothing here reads `config.model_type`.
- `Attention` (QKV projection, RoPE, optional q/k norm, its own KV write, the backend's
  attention, output projection), `GatedMLP`, `DecoderLayer` (pre-norm, SGLang's fused
  residual layout, and the C++ fused decode path), `DecoderModel` and `CausalLM` (LM head,
  logits, quantization after loading, weight loading).
- `StackedParam` / `stacked_param_target`: checkpoint names that load into a fused
  parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj), matched on whole name components.

The forward takes the `ForwardBatch` explicitly: no global state. Submodules are run by
calling their `forward` directly, not through `nn.Module.__call__`: its hook bookkeeping
costs about 1-3 us a call on CPU, and a decode step makes ~10 such calls per layer, a
measurable share of a small model's step (Tandem registers no hooks).

Under tensor parallelism each rank holds its share of the attention heads (KV heads
replicated when there are fewer than ranks: `layers/linear.py`, `HeadSplit`), of the
MLP's intermediate size and of the vocabulary; the norms are replicated. Every rank
ends with the same full logits.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tandem.forward_batch import ForwardBatch
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.activation import GeluTanhAndMul, SiluAndMul
from tandem.layers.layernorm import RMSNorm
from tandem.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from tandem.layers.quantization.gguf_linear import place_in_huge_pages
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.weight_shard import CheckpointTensor, read_whole
from tandem.mem_cache.memory_pool import widened_pool
from tandem.models.context import ModelContext
from tandem.sglang_flags import QUANTIZE_AT_LOAD

if TYPE_CHECKING:
    from tandem.lora.batch import LoraBatch

logger = logging.getLogger(__name__)


# ---- config helpers ------------------------------------------------------------------------


def rope_settings(config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either the old (`rope_theta`/`rope_scaling`) or
    the transformers 5 (`rope_parameters`) form of a config. The scaling dict gets the
    config's top-level `original_max_position_embeddings` (Phi-3's old form) if it lacks one."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None) or params
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    scaling = dict(scaling)
    if scaling.get("original_max_position_embeddings") is None:
        orig = getattr(config, "original_max_position_embeddings", None)
        if orig is not None:
            scaling["original_max_position_embeddings"] = orig
    return float(theta), scaling


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config) -> int:
    """The rotated width of each head: `head_dim * partial_rotary_factor` (from the config
    or transformers 5's `rope_parameters`; Phi-4-mini's 0.75), as transformers truncates it;
    the rest of the head passes unrotated."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", None) or params.get("partial_rotary_factor") or 1.0
    return int(head_dim_of(config) * factor)


def make_rotary_embedding(config) -> RotaryEmbedding:
    """The model's one rotary embedding: every layer rotates by the same table (as
    SGLang's `get_rope` cache shares one), looked up once per forward."""
    theta, scaling = rope_settings(config)
    head_dim = head_dim_of(config)
    return RotaryEmbedding(
        head_dim,
        rotary_dim_of(config),
        config.max_position_embeddings,
        theta,
        scaling,
        freq_factors=getattr(config, "rope_freq_factors", None),
    )


# ---- per-layer options ---------------------------------------------------------------------

# The MLP's gated activations: name -> module applied to the fused gate/up output.
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}


@dataclass(frozen=True)
class LayerOptions:
    """What one decoder layer does differently from the plain Llama layer."""

    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2; Llama's `attention_bias`)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    activation: str = "silu"  # the MLP's gated activation, a key of ACTIVATIONS
    sliding_window: int = 0  # > 0: the query at p sees the keys at (p - window, p] (Gemma's sliding layers)
    attn_logit_softcap: float = 0.0  # > 0: scores = cap * tanh(scores / cap) (Gemma 2)
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {self.activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")


# ---- layers --------------------------------------------------------------------------------


class Attention(nn.Module):
    """Self-attention of one layer: writes this layer's K/V into the pool itself, then
    attends through the context's backend."""

    def __init__(
        self, config, layer_id: int, tp_rank: int, tp_size: int, rotary_emb: RotaryEmbedding, options: LayerOptions
    ):
        super().__init__()
        self.layer_id = layer_id
        self.options = options
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, options.qkv_bias, tp_rank, tp_size
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5 if options.attn_scale is None else options.attn_scale
        self.sliding_window, self.logit_cap = options.sliding_window, options.attn_logit_softcap
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, False, tp_rank, tp_size)
        self.qk_norm = options.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb

    def forward(self, cos_sin: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, ctx: ModelContext):
        """`cos_sin`: the batch's tokens' rotation, `RotaryEmbedding.lookup(positions)`."""
        qkv = self.qkv_proj.forward(hidden, ctx.lora)
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
        out = ctx.attn_backend.forward(
            q,
            self.layer_id,
            fb,
            self.scaling,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            sliding_window=self.sliding_window,
            logit_cap=self.logit_cap,
        )
        return self.o_proj.forward(out, ctx.lora)


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, gate and up fused in one column-parallel linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int, activation: str = "silu"):
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [inter, inter], False, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(inter, hidden_size, False, tp_rank, tp_size)
        self.activation = activation
        self.act_fn = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora`: the forward's adapters (`ModelContext.lora`), whose deltas the projections add."""
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x, lora)), lora)


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, the residual adds fused into the norms."""

    def __init__(
        self,
        config,
        layer_id: int,
        tp_rank: int,
        tp_size: int,
        rotary_emb: RotaryEmbedding,
        options: LayerOptions,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.self_attn = Attention(config, layer_id, tp_rank, tp_size, rotary_emb, options)
        # `mlp`: the family's own block for this layer (a MoE block, `CausalLM.make_mlp`), else the dense one
        if mlp is None:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size, options.activation)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = None  # set by prepare_fused_decode once the weights are loaded

    def prepare_fused_decode(self) -> None:
        """`fused_decode`: the weights `tandem_cpu.decode_layer` takes, when it can run this
        layer (one tensor-parallel rank, every linear quantized, no per-head q/k norm, no
        sliding window or logit soft-cap, a SiLU MLP, the C++ kernels built), else None."""
        self.fused_decode = None
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, GatedMLP):  # a family's own MLP block (MoE): the kernel computes a GatedMLP
            return
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ops = cpu_kernels.load()
        if (
            ops is None
            or attn.qkv_proj.tp_size != 1
            or attn.qk_norm
            or attn.sliding_window
            or attn.logit_cap
            or mlp.activation != "silu"
            or any(m.quant_kernel is None for m in linears)
            or self.input_layernorm.eps != self.post_attention_layernorm.eps
        ):
            return
        kernels = [m.quant_kernel for m in linears]
        weights = [k.tensors() for k in kernels]
        formats = [v for k in kernels for v in k.fused_format()]
        self.fused_decode = (ops.decode_layer, weights, formats, min(k.max_rows for k in kernels))

    def forward_fused(self, cos_sin, hidden, residual, fb, ctx, tables):
        """`forward` of a decode batch in one C++ call (`prepare_fused_decode`; the same
        kernels in the same order, so the same result)."""
        op, weights, formats, _ = self.fused_decode
        attn, layer_id = self.self_attn, self.self_attn.layer_id
        return op(
            hidden,
            residual,
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.input_layernorm.eps,
            *weights,
            formats,
            cos_sin,
            ctx.kv_pool.k_buffer[layer_id],
            ctx.kv_pool.v_buffer[layer_id],
            fb.out_cache_loc,
            *tables,
            attn.scaling,
            attn.num_heads,
            attn.num_kv_heads,
        )

    def forward(self, cos_sin, hidden, residual, fb, ctx):
        """(MLP output, residual): the residual adds happen in the next norm's call
        (SGLang's layout); `residual` is None for the first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm.forward(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(cos_sin, hidden, fb, ctx)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        if ctx.lora is not None and isinstance(self.mlp, GatedMLP):
            return self.mlp.forward(hidden, ctx.lora), residual
        return self.mlp.forward(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers (each with `layer_options(config, i)`), final norm."""

    def __init__(
        self,
        config,
        tp_rank: int,
        tp_size: int,
        layer_options: Callable[[object, int], LayerOptions],
        make_mlp: Callable[[object, int, int, int], nn.Module | None] | None = None,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.rotary_emb = make_rotary_embedding(config)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(
                    config,
                    i,
                    tp_rank,
                    tp_size,
                    self.rotary_emb,
                    layer_options(config, i),
                    make_mlp(config, i, tp_rank, tp_size) if make_mlp else None,
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._stack_cache: tuple | None = None  # (the layers' fused_decode, `_fused_stack()`)

    def forward(self, input_ids, positions, fb, ctx):
        hidden, residual = self.embed_tokens.forward(input_ids), None
        cos_sin = self.rotary_emb.lookup(positions)
        tables = self._fused_decode_tables(hidden, cos_sin, fb, ctx)
        stack = self._fused_stack() if tables is not None else None
        if stack is not None:  # every layer in one C++ call: `forward_fused` of each, in order
            op, weights, layout, eps, scale, num_heads, num_kv_heads = stack
            pool, n = ctx.kv_pool, len(layout) // 16
            k, v = pool.k_buffer, pool.v_buffer
            if len(k) != n:
                k, v = k[:n], v[:n]
            hidden, residual = op(
                hidden, weights, layout, eps, cos_sin, k, v, fb.out_cache_loc, *tables, scale, num_heads, num_kv_heads
            )
            return self.norm.forward(hidden, residual)[0]
        for layer in self.layers:
            if tables is not None and layer.fused_decode is not None:
                hidden, residual = layer.forward_fused(cos_sin, hidden, residual, fb, ctx, tables)
            else:
                hidden, residual = layer.forward(cos_sin, hidden, residual, fb, ctx)
        return self.norm.forward(hidden, residual)[0]

    def _fused_stack(self):
        """`tandem_cpu.decode_layers`' arguments that stay from step to step (op, weights,
        layout, eps, scale, heads, KV heads), when every layer runs fused
        (`DecoderLayer.prepare_fused_decode`) with the same norm eps, attention scale and
        heads, layer i reading the pool's buffer i; else None (each layer's own call, or the
        Python layer). Rebuilt when a layer's `fused_decode` changes."""
        fused = tuple(layer.fused_decode for layer in self.layers)
        cached = self._stack_cache
        if cached is not None and len(cached[0]) == len(fused) and all(a is b for a, b in zip(cached[0], fused)):
            return cached[1]
        stack = self._build_stack(fused)
        self._stack_cache = (fused, stack)
        return stack

    def _build_stack(self, fused: tuple):
        ops = cpu_kernels.load()
        if not fused or any(f is None for f in fused) or ops is None or not hasattr(ops, "decode_layers"):
            return None

        def params(layer):
            attn = layer.self_attn
            return layer.input_layernorm.eps, attn.scaling, attn.num_heads, attn.num_kv_heads

        first = params(self.layers[0])
        if any(params(layer) != first or layer.self_attn.layer_id != i for i, layer in enumerate(self.layers)):
            return None
        weights, layout = [], []
        for layer, (_, linear_weights, formats, _) in zip(self.layers, fused):
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for w in linear_weights:
                weights += w
            layout += [len(w) for w in linear_weights] + list(formats)
        return (ops.decode_layers, weights, layout, *first)

    def _fused_decode_tables(self, hidden, cos_sin, fb, ctx):
        """The attention tables for `DecoderLayer.forward_fused` when this forward may run
        its layers so: a plain decode on the C++ CPU kernels, of rows few enough for every
        fused layer's quantized matmuls (`QuantLinearKernel.max_rows`), rotation and
        activations in one dtype, the pool in it too or 16-bit beside float32 activations
        (--kv-cache-dtype), and no LoRA adapter in the batch."""
        max_rows = min((f[3] for layer in self.layers if (f := layer.fused_decode) is not None), default=0)
        if fb.batch_size > max_rows or hidden.dim() != 2 or fb.out_cache_loc.dtype != torch.int64:
            return None
        if ctx.lora is not None:  # the fused layer adds no LoRA delta
            return None
        pool_ok = ctx.kv_pool.dtype == hidden.dtype or widened_pool(hidden.dtype, ctx.kv_pool.dtype)
        if hidden.dtype != cos_sin.dtype or not pool_ok or not hidden.is_cpu:
            return None
        return ctx.attn_backend.cpu_decode_tables(fb)


# ---- weight loading ------------------------------------------------------------------------


@dataclass(frozen=True)
class StackedParam:
    """Checkpoint tensors named `...<checkpoint>...` load as shard `shard_id` of the fused
    parameter `...<param>...`; both are dotted runs of whole name components."""

    checkpoint: str
    param: str
    shard_id: str | int


# The dense decoder's fused projections. Anchored on the parent module ("self_attn",
# "mlp"), so `mlp.experts.3.gate_proj` (an expert's own projection) is not one of them.
DENSE_STACKED_PARAMS: tuple[StackedParam, ...] = (
    StackedParam("self_attn.q_proj", "self_attn.qkv_proj", "q"),
    StackedParam("self_attn.k_proj", "self_attn.qkv_proj", "k"),
    StackedParam("self_attn.v_proj", "self_attn.qkv_proj", "v"),
    StackedParam("mlp.gate_proj", "mlp.gate_up_proj", 0),
    StackedParam("mlp.up_proj", "mlp.gate_up_proj", 1),
)


def stacked_param_target(name: str, mapping: Iterable[StackedParam]) -> tuple[str, str | int] | None:
    """(fused parameter name, shard id) for checkpoint tensor `name`, or None when no entry
    of `mapping` matches a run of its whole dot-separated components."""
    parts = name.split(".")
    for entry in mapping:
        want = entry.checkpoint.split(".")
        n = len(want)
        for i in range(len(parts) - n + 1):
            if parts[i : i + n] == want:
                return ".".join(parts[:i] + entry.param.split(".") + parts[i + n :]), entry.shard_id
    return None


def load_named_weights(
    params: dict[str, nn.Parameter],
    weights: Iterable[tuple[str, CheckpointTensor]],
    mapping: Iterable[StackedParam],
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Copy each checkpoint tensor (its part this rank owns, through the parameter's
    `weight_loader` when it has one) into `params`; the names loaded. ValueError for a
    name that is neither a parameter nor stacked into one; `skip(name)` ones are passed."""
    mapping = tuple(mapping)
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        stacked = stacked_param_target(name, mapping)
        if stacked is not None:
            target, shard_id = stacked
            if target not in params:
                raise ValueError(f"unexpected weight in checkpoint: {name}")
            param = params[target]
            param.weight_loader(param, tensor, shard_id)
            loaded.add(target)
            continue
        if name not in params:
            raise ValueError(f"unexpected weight in checkpoint: {name}")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor)
        else:
            param.data.copy_(read_whole(tensor))
        loaded.add(name)
    return loaded


# ---- the causal LM -------------------------------------------------------------------------


class CausalLM(nn.Module):
    """A decoder-only model with an LM head. Returns each request's next-token logits
    (float32), and prompt logprobs on request. A family subclasses it and says its
    `layer_options`; the registry (`tandem/models/registry.py`) maps its architecture
    names to it."""

    stacked_params: ClassVar[tuple[StackedParam, ...]] = DENSE_STACKED_PARAMS

    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        """The options of decoder layer `layer_id` (the plain Llama layer by default)."""
        return LayerOptions()

    @classmethod
    def make_mlp(cls, config, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module | None:
        """The MLP block of decoder layer `layer_id` when the family has its own there
        (a mixture-of-experts block: `tandem/models/moe.py`); None for the dense `GatedMLP`."""
        return None

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, tp_rank, tp_size, self.layer_options, self.make_mlp)
        self.logits_processor = LogitsProcessor()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if self.tie_word_embeddings:
            # One parameter under two names; the checkpoint's lm_head.weight (if any) is skipped.
            self.lm_head.weight = self.model.embed_tokens.weight

    def process_weights_after_loading(
        self, linear_backend: str, quantization: str | None = None, int8_x: bool = False
    ) -> None:
        """Choose every linear layer's matmul kernel (`--linear-backend`) once loaded;
        `--quantization` q8_0/q4_0/q4_1 quantizes each one's weight first, the LM head's
        too (a tied head's quantized weight is then also the embedding's). `int8_x`: the
        quantized matmuls round float32 rows to int8 too (`QuantLinearKernel`)."""
        at_load = quantization if quantization in QUANTIZE_AT_LOAD else None
        dequantized: set[str] = set()
        linears = [(name, m) for name, m in self.named_modules() if isinstance(m, LinearBase)]
        for _, module in linears:
            # A tied head shares its weight with the embedding lookup: keep it.
            keep = module is self.lm_head and self.tie_word_embeddings
            module.process_weights_after_loading(linear_backend, keep_weight=keep, quantization=at_load, int8_x=int8_x)
            dequantized |= module.dequantized_types - {"F32", "F16", "BF16"}
        place_in_huge_pages([m.quant_kernel for _, m in linears if m.quant_kernel is not None])
        for layer in self.model.layers:
            layer.prepare_fused_decode()
        # a tied head whose blocks take every input leaves the table to the embedding alone
        self.model.embed_tokens.finish_loading(
            shared_with_head=self.tie_word_embeddings and not self.lm_head.serves_every_input()
        )
        if dequantized and linear_backend == "auto":
            logger.info(
                "GGUF tensors of type %s run dequantized (no quantized CPU kernel for them here)",
                ", ".join(sorted(dequantized)),
            )
        if at_load:
            done = [m for _, m in linears if m.quantized_at_load]
            dense = sorted({re.sub(r"\.\d+\.", ".*.", name) for name, m in linears if not m.quantized_at_load})
            logger.info(
                "--quantization %s: %d of %d linear layers quantized (%d on the quantized kernel)%s",
                at_load,
                len(done),
                len(linears),
                sum(m.quant_kernel is not None for m in done),
                f"; dense (input width not a multiple of 32): {', '.join(dense)}" if dense else "",
            )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, ctx: ModelContext) -> LogitsProcessorOutput:
        hidden = self.model.forward(fb.input_ids, fb.positions, fb, ctx)
        return self.logits_processor(hidden, self.lm_head.forward, fb)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]], require_all: bool = True) -> set[str]:
        """Copy each checkpoint tensor's part that this rank owns into its parameter;
        ValueError for an unknown name or, with `require_all`, a parameter left unloaded.
        Returns the names of the parameters loaded."""
        params = dict(self.named_parameters())
        tied = self.tie_word_embeddings

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head."))

        def with_tied_head(stream):
            for name, tensor in stream:
                if tied and name == "model.embed_tokens.weight":  # the head's GGUF blocks too
                    self.lm_head.keep_shard_blocks(tensor)
                yield name, tensor

        loaded = load_named_weights(params, with_tied_head(weights), self.stacked_params, skip)
        missing = set(params) - loaded
        if missing and require_all:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")
        return loaded
