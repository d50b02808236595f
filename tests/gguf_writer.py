"""Write GGUF files from make_tiny_model's Hugging Face directories, as llama.cpp would.

:func:`write_gguf` writes what llama.cpp's ``convert_hf_to_gguf.py`` writes for such a
directory (its ``LlamaModel``, ``Qwen2Model`` and ``Qwen3Model`` paths), through gguf-py's
``GGUFWriter``; and, without a tokenizer, for a directory of the other families'
transformers models (``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel``,
``Qwen2MoeModel``, ``Qwen3MoeModel``, and ``LlamaModel`` for Mixtral): their metadata
(:func:`write_family_metadata`: soft-caps, window, rotary width, expert counts and
sizes), each expert's matrices stacked ``[experts, out, in]`` (:func:`stack_experts`),
Gemma's norms stored as ``1 + w``, Phi-3's longrope factors as tensors:

* metadata: ``general.architecture`` (llama / qwen2 / qwen3), ``general.type``,
  ``general.name``, ``general.file_type``, ``general.quantization_version``; the
  ``{arch}.`` hyperparameters of ``TextModel.set_gguf_parameters`` (block_count,
  context_length, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon,
  attention.key_length / value_length since the config states ``head_dim``) and, for
  llama only, ``vocab_size`` and ``rope.dimension_count``;
* tensors under llama.cpp's names (gguf-py's own HF -> GGUF tensor map): ``token_embd``,
  ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_q_norm, attn_k_norm, attn_output,
  ffn_norm, ffn_gate, ffn_up, ffn_down}``, ``output_norm``, ``output`` (absent when the
  embeddings are tied: the HF file has no ``lm_head``); Q/K rows permuted for the llama
  architecture exactly as ``LlamaModel.permute`` does (qwen2/qwen3 keep HF's layout);
  1-D tensors (norms, biases) in F32, every 2-D weight in ``tensor_type``;
* the tokenizer: byte-level BPE (qwen2, qwen3) as ``_set_vocab_gpt2`` writes it
  (``tokenizer.ggml.model`` "gpt2", ``pre`` "qwen2" -- the pre-tokenizer llama.cpp
  names for Qwen2's split regex --, tokens, token types, merges); the llama model's
  SentencePiece-style BPE with byte fallback as ``_set_vocab_llama_hf`` writes it
  (``model`` "llama", ``pre`` "default", tokens, scores, token types, no merges), with
  two departures that make the file describe the tokenizer (real scores instead of the
  -1000 placeholder, special added tokens CONTROL; see :func:`_llama_hf_vocab`); then
  gguf-py's ``SpecialVocab`` (llama.cpp's own code): bos/eos/unk/pad ids,
  ``add_bos_token``/``add_eos_token`` (and ``add_sep_token`` for llama), ``chat_template``.

Tensors go in model order (embeddings, blocks, final norm, head), so a split set's last file
holds the last blocks and the head.

:func:`quantize` packs a 2-D float array into ggml blocks of any supported type: gguf-py's
quantizers for F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the simple ones below for the
K-quants (Q2_K..Q6_K; gguf-py has none), IQ4_NL, IQ4_XS and Q8_K. These are round-to-nearest with
min/max scales, not llama.cpp's error-minimising search, but every block is in ggml's exact
byte layout (the inverse of ``gguf.quants.dequantize``), every scale finite.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType as FT
from safetensors.numpy import load_file

SUPPORTED_TYPES = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"),
)

# general.file_type llama.cpp records for a file whose 2-D weights are all of one type
# (llama-quantize's "_S" mixes are the ones closest to uniform).
FILE_TYPES = {
    "F32": FT.ALL_F32,
    "F16": FT.MOSTLY_F16,
    "BF16": FT.MOSTLY_BF16,
    "Q8_0": FT.MOSTLY_Q8_0,
    "Q4_0": FT.MOSTLY_Q4_0,
    "Q4_1": FT.MOSTLY_Q4_1,
    "Q5_0": FT.MOSTLY_Q5_0,
    "Q5_1": FT.MOSTLY_Q5_1,
    "Q2_K": FT.MOSTLY_Q2_K,
    "Q3_K": FT.MOSTLY_Q3_K_S,
    "Q4_K": FT.MOSTLY_Q4_K_S,
    "Q5_K": FT.MOSTLY_Q5_K_S,
    "Q6_K": FT.MOSTLY_Q6_K,
    "IQ4_NL": FT.MOSTLY_IQ4_NL,
    "IQ4_XS": FT.MOSTLY_IQ4_XS,
}

MODEL_ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,  # llama.cpp's LlamaModel converts Mixtral
}
# The families whose Q/K rows llama.cpp permutes (its LlamaModel path).
PERMUTED = ("llama", "mixtral")
# One expert's matrix in a Hugging Face checkpoint: llama.cpp stacks them over the experts.
EXPERT_RE = re.compile(r"^(?P<head>.*\.experts)\.(?P<expert>\d+)\.(?P<tail>.*)$")

# llama.cpp's name for Qwen2's pre-tokenizer regex (convert_hf_to_gguf's hash table maps
# Qwen1.5/Qwen2/Qwen3 tokenizers to it); the tiny byte-level tokenizer uses that regex.
QWEN2_PRE = "qwen2"


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's rotate-half Q/K rows to ggml's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` for a config with Llama 3 RoPE scaling (None otherwise):
    each rotary frequency's divisor, 1 for short wavelengths, `factor` for long ones and
    smoothly between (convert_hf_to_gguf's LlamaModel.generate_extra_tensors)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """The float32 tensors llama.cpp writes for ``model_dir``, by GGUF name, in file order
    (before any quantization): renamed, Q/K permuted for llama, tied ``lm_head`` absent."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    model_type = config["model_type"]
    n_layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(MODEL_ARCHS[model_type], n_layers)
    hf = load_file(str(model_dir / "model.safetensors"))
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads")

    def key(hf_name: str) -> tuple:  # embeddings, blocks in order, final norm, head
        parts = hf_name.split(".")
        if parts[:2] == ["model", "layers"]:
            return (1, int(parts[2]))
        return {"model.embed_tokens.weight": (0, 0), "model.norm.weight": (2, 0)}.get(hf_name, (3, 0))

    out: dict[str, np.ndarray] = {}
    factors = llama3_rope_factors(config)
    if factors is not None:  # LlamaModel.generate_extra_tensors writes them first
        out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = factors
    out.update(longrope_factors(config))
    hf = stack_experts(hf)
    for hf_name in sorted(hf, key=key):  # stable: the safetensors order within a block
        data = hf[hf_name].astype(np.float32)
        if model_type.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1  # Gemma*Model.modify_tensors: llama.cpp's RMSNorm multiplies by the weight
        if hf_name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is {n_embd}
        if model_type in PERMUTED:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute(data, n_head, n_head)
            if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute(data, n_head, n_kv)
        new_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"cannot map tensor {hf_name!r}")
        out[new_name] = np.ascontiguousarray(data)
    return out


def stack_experts(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint with each expert's matrices stacked over the experts as llama.cpp's
    converters write them ([experts, out, in] under the name without the expert number:
    `mlp.experts.gate_proj`, `block_sparse_moe.experts.w1`, which gguf-py maps to
    `ffn_gate_exps`), in the place of the first expert's."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for name, data in hf.items():
        m = EXPERT_RE.match(name)
        if m is None:
            out[name] = data
            continue
        stacked = f"{m['head']}.{m['tail']}"
        if stacked not in groups:
            groups[stacked] = {}
            out[stacked] = None  # its place in the order
        groups[stacked][int(m["expert"])] = data
    for name, experts in groups.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def per_expert_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each stacked ``blk.N.ffn_{gate,up,down}_exps`` as one tensor per expert,
    ``blk.N.ffn_{gate,up,down}.E`` (llama.cpp's early Mixtral files)."""
    out: dict[str, np.ndarray] = {}
    for name, data in tensors.items():
        base, _, suffix = name.rpartition(".")
        if not base.endswith("_exps"):
            out[name] = data
            continue
        for e in range(data.shape[0]):
            out[f"{base.removesuffix('_exps')}.{e}.{suffix}"] = np.ascontiguousarray(data[e])
    return out


def longrope_factors(config: dict) -> dict[str, np.ndarray]:
    """Phi-3's longrope factors as tensors (Phi3MiniModel.generate_extra_tensors), if any."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not scaling.get("long_factor"):
        return {}
    return {
        "rope_factors_long.weight": np.array(scaling["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(scaling["short_factor"], dtype=np.float32),
    }


def rope_theta(config: dict) -> float:
    """The (global layers') RoPE base of a config in either transformers form."""
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return float(config.get("rope_theta") or params.get("rope_theta", 10000.0))


def write_family_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """What the family's converter adds to TextModel's hyperparameters (Gemma2Model,
    Gemma3Model, Phi3MiniModel, Qwen2MoeModel, Qwen3MoeModel, LlamaModel for Mixtral)."""
    model_type = config["model_type"]
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    elif model_type == "gemma3_text":
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    elif model_type == "phi3":
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(int(config.get("partial_rotary_factor", 1.0) * head_dim))
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if longrope_factors(config):
            scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
            attn = math.sqrt(1 + math.log(scale) / math.log(config["original_max_position_embeddings"]))
            writer.add_rope_scaling_attn_factors(attn if scale > 1 else 1.0)
    if "num_experts" in config or "num_local_experts" in config:
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


# ----------------------------------------------------------------------------- quantizers


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    den = np.asarray(den, dtype=np.float32)
    return np.where(den != 0, num / np.where(den != 0, den, 1), 0).astype(np.float32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, with its sign."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)[..., 0]


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins (get_scale_min_k4's inverse)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _quantize_affine_k(x: np.ndarray, levels: int, scale_bits: int):
    """Q2_K/Q4_K/Q5_K: y = d*sc*q - dmin*m per sub-block (last axis of ``x``), q in
    [0, levels]: the sub-block's min (at most 0) and max set its scale and min, quantized
    to ``scale_bits`` against the super-block's f16 d and dmin; q is then rounded against
    the quantized scale and min."""
    smax = (1 << scale_bits) - 1
    xmin = np.minimum(x.min(axis=-1), 0)
    scale, mins = (x.max(axis=-1) - xmin) / levels, -xmin
    d = _f16(scale.max(axis=-1) / smax)
    dmin = _f16(mins.max(axis=-1) / smax)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_safe_div(scale, d32)), 0, smax)
    mq = np.clip(np.rint(_safe_div(mins, dmin32)), 0, smax)
    eff_scale = (d32 * sc)[..., None]
    eff_min = (dmin32 * mq)[..., None]
    q = np.clip(np.rint(_safe_div(x + eff_min, eff_scale)), 0, levels).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), mq.astype(np.uint8), q


def _quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, mq, q = _quantize_affine_k(blocks.reshape(n, 16, 16), 3, 4)
    scales = sc | (mq << 4)
    q = q.reshape(n, 2, 4, 32)  # element h*128 + s*32 + l -> qs[h*32 + l] bits 2s
    qs = (q << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8)
    return np.concatenate(
        [scales, qs.reshape(n, 64), d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2)], axis=1
    )


def _quantize_symmetric_k(x: np.ndarray, q_min: int, sc_min: int):
    """Q3_K/Q6_K's signed codes: per 16-value sub-block of x [n, 16, 16] a scale whose
    largest magnitude maps to `q_min`, stored as integers in [sc_min, -sc_min) of one f16
    super-scale d; returns (d, sc, q) with q in [q_min, -q_min) (floats)."""
    scale = _signed_absmax(x) / q_min
    d = _f16(_signed_absmax(scale) / sc_min)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_safe_div(scale, d32)), sc_min, -sc_min - 1)
    q = np.clip(np.rint(_safe_div(x, (d32 * sc)[..., None])), q_min, -q_min - 1)
    return d, sc, q


def _quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, sc, q = _quantize_symmetric_k(blocks.reshape(n, 16, 16), -4, -32)
    q3 = (q.astype(np.int8) + 4).astype(np.uint8).reshape(n, 256)
    low = (q3 & 3).reshape(n, 2, 4, 32)  # element h*128 + s*32 + l -> qs[h*32 + l] bits 2s
    qs = (low << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8)
    high = (q3 >> 2).reshape(n, 8, 32)  # element b*32 + l -> hmask[l] bit b
    hmask = (high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    us = (sc + 32).astype(np.uint8)  # 6-bit, offset 32
    scales = np.zeros((n, 12), dtype=np.uint8)
    for j in range(16):
        scales[:, j % 8] |= (us[:, j] & 0xF) << (4 * (j // 8))
        scales[:, 8 + j % 4] |= (us[:, j] >> 4) << (2 * (j // 4))
    return np.concatenate([hmask, qs.reshape(n, 64), scales, d.view(np.uint8).reshape(n, 2)], axis=1)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, mq, q = _quantize_affine_k(blocks.reshape(n, 8, 32), 15, 6)
    q = q.reshape(n, 4, 2, 32)  # element c*64 + t*32 + l -> qs[c*32 + l] nibble t
    qs = q[:, :, 0, :] | (q[:, :, 1, :] << 4)
    return np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k_scales(sc, mq), qs.reshape(n, 128)],
        axis=1,
    )


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, mq, q = _quantize_affine_k(blocks.reshape(n, 8, 32), 31, 6)
    low = (q & 0xF).reshape(n, 4, 2, 32)
    qs = low[:, :, 0, :] | (low[:, :, 1, :] << 4)
    high = (q >> 4).reshape(n, 8, 32)  # element b*32 + l -> qh[l] bit b
    qh = (high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate(
        [
            d.view(np.uint8).reshape(n, 2),
            dmin.view(np.uint8).reshape(n, 2),
            _pack_k_scales(sc, mq),
            qh,
            qs.reshape(n, 128),
        ],
        axis=1,
    )


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, sc, q = _quantize_symmetric_k(blocks.reshape(n, 16, 16), -32, -128)
    u = (q + 32).astype(np.uint8).reshape(n, 256)
    low = (u & 0xF).reshape(n, 2, 2, 64)  # element h*128 + t*64 + k -> ql[h*64 + k] nibble t
    ql = low[:, :, 0, :] | (low[:, :, 1, :] << 4)
    high = (u >> 4).reshape(n, 2, 4, 32)  # element h*128 + s*32 + l -> qh[h*32 + l] bits 2s
    qh = (high << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)],
        axis=1,
    )


IQ4_NL_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def _quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL (a non-linear 4-bit grid): nearest grid value; for files of a type a loader
    may not support."""
    n = blocks.shape[0]
    d = _f16(_signed_absmax(blocks) / -127)  # the largest magnitude maps to -127
    y = _safe_div(blocks, d.astype(np.float32)[:, None])
    idx = np.abs(y[..., None] - IQ4_NL_VALUES).argmin(axis=-1).astype(np.uint8)  # element t*16 + k
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), qs], axis=1)


def _quantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS (IQ4_NL's grid, a 6-bit signed scale per 32 under an f16 scale per 256): each
    sub-block's scale as IQ4_NL's, rounded to a multiple of d = largest / 31; then the
    nearest grid value."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    want = _signed_absmax(sub) / -127  # [n, 8]
    d = _f16(np.abs(want).max(axis=1) / 31)
    ls = np.clip(np.round(_safe_div(want, d.astype(np.float32)[:, None])), -32, 31).astype(np.int16) + 32
    dl = d.astype(np.float32)[:, None] * (ls - 32).astype(np.float32)
    y = _safe_div(sub, dl[..., None])
    idx = np.abs(y[..., None] - IQ4_NL_VALUES).argmin(axis=-1).astype(np.uint8)  # [n, 8, 32]
    qs = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(n, 128)
    ls = ls.astype(np.uint8)
    scales_l = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)  # [n, 4]
    high = (ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))
    scales_h = high.sum(axis=1, dtype=np.uint16).astype("<u2")
    return np.concatenate([d.view(np.uint8).reshape(n, 2), scales_h.view(np.uint8).reshape(n, 2), scales_l, qs], axis=1)


def _quantize_q8_k(blocks: np.ndarray) -> np.ndarray:
    """Q8_K (llama.cpp's activation type, which gguf-py does not dequantize): a float32 scale,
    256 int8 values, 16 int16 sums of 16; for files of a type no loader takes as a weight."""
    n = blocks.shape[0]
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float32)
    q = np.clip(np.round(_safe_div(blocks, d[:, None])), -127, 127).astype(np.int8)
    sums = q.reshape(n, 16, 16).sum(axis=2, dtype=np.int16).astype("<i2")
    return np.concatenate(
        [d.view(np.uint8).reshape(n, 4), q.view(np.uint8), sums.view(np.uint8).reshape(n, 32)], axis=1
    )


_OWN_QUANTIZERS = {
    QT.Q2_K: _quantize_q2_k,
    QT.Q3_K: _quantize_q3_k,
    QT.Q4_K: _quantize_q4_k,
    QT.Q5_K: _quantize_q5_k,
    QT.Q6_K: _quantize_q6_k,
    QT.IQ4_NL: _quantize_iq4_nl,
    QT.IQ4_XS: _quantize_iq4_xs,
    QT.Q8_K: _quantize_q8_k,
}


def quantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """``data`` (float, last axis a multiple of the block size) in ggml type ``type_name``:
    float32/float16 arrays for F32/F16, else uint8 rows of packed blocks (as gguf-py's
    ``gguf.quants.quantize`` returns them and ``GGUFWriter.add_tensor`` takes them)."""
    qtype = QT[type_name]
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype in _OWN_QUANTIZERS:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if data.shape[-1] % block_size:
            raise ValueError(f"{type_name} needs rows of a multiple of {block_size}, got {data.shape}")
        packed = _OWN_QUANTIZERS[qtype](data.reshape(-1, block_size))
        assert packed.shape[1] == type_size, (type_name, packed.shape)
        return packed.reshape(*data.shape[:-1], data.shape[-1] // block_size * type_size)
    return gguf.quants.quantize(data, qtype)


def dequantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantizer (what transformers' GGUF loader uses)."""
    return gguf.quants.dequantize(data, QT[type_name])


# ----------------------------------------------------------------------------- tokenizer


def _llama_hf_vocab(model_dir: Path) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types for a SentencePiece-style BPE ``tokenizer.json``.

    llama.cpp's ``LlamaHfVocab`` gives every token the placeholder score -1000, and takes
    its token types from ``tokenizer.all_special_ids``, which (transformers 5) no longer
    lists special added tokens that only ``special_tokens_map.json`` names, so
    ``<|im_start|>``/``<|im_end|>`` would come out NORMAL (matched as text, not as one
    token). Neither describes the tokenizer: a "llama" vocabulary has no merges, so both
    llama.cpp's SPM tokenizer and transformers (which rebuilds merges from the scores)
    merge by score, and with all scores equal transformers orders its merges by piece
    length (89 of 934 test texts then tokenize differently). So here a learned piece
    scores ``-rank`` of the merge that makes it (as in a SentencePiece BPE model; single
    characters score below every merge, specials and byte tokens 0) and tokens marked
    special in ``added_tokens_decoder`` are CONTROL. No merges are written, as llama.cpp
    writes none for this vocabulary: a reader has to go through the scores, as it must
    for a real Llama-2 file; transformers then tokenizes exactly like the HF directory
    (the corpus and 5000 random snippets of it), except for its own two SentencePiece
    quirks (no doubled dummy prefix on text that starts with a space, none after a
    special token), which no metadata can change.
    """
    tokenizer_json = _read_json(model_dir / "tokenizer.json")
    model = tokenizer_json["model"]
    if model["type"] != "BPE" or not model.get("byte_fallback") or tokenizer_json["decoder"]["type"] != "Sequence":
        raise ValueError("not a Llama-style BPE tokenizer.json (byte fallback, Sequence decoder)")
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    special_ids = {t["id"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    rank = {a + b: k for k, (a, b) in enumerate(merges)}
    n_merges = len(merges)
    scores, types = [], []
    for i, piece in enumerate(tokens):
        if i in special_ids:
            scores.append(0.0)
            types.append(gguf.TokenType.CONTROL)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            scores.append(0.0)
            types.append(gguf.TokenType.BYTE)
        else:
            scores.append(-float(rank[piece]) if piece in rank else -float(n_merges + i))
            types.append(gguf.TokenType.NORMAL)
    return tokens, scores, [int(t) for t in types]


def _bpe_vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """``get_vocab_base``: byte-level tokens in id order, special added tokens CONTROL."""
    tokenizer_json = _read_json(model_dir / "tokenizer.json")
    vocab: dict[str, int] = dict(tokenizer_json["model"]["vocab"])
    added = {t["id"]: t for t in tokenizer_json.get("added_tokens", [])}
    for i, t in added.items():
        vocab.setdefault(t["content"], i)
    reverse = {i: piece for piece, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, model_type: str, vocab_size: int) -> None:
    if model_type == "llama":
        tokens, scores, types = _llama_hf_vocab(model_dir)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    else:
        tokens, types = _bpe_vocab(model_dir, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(QWEN2_PRE)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)


# ----------------------------------------------------------------------------- writer


def shard_paths(out_path: str | Path, split: int) -> list[Path]:
    """llama.cpp's split names (gguf-split, GGUFWriter): ``<stem>-00001-of-0000N.gguf``."""
    out_path = Path(out_path)
    return [out_path.with_name(f"{out_path.stem}-{i:05d}-of-{split:05d}.gguf") for i in range(1, split + 1)]


def write_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    tensor_type: str = "F32",
    *,
    tokenizer: bool = True,
    architecture: str | None = None,
    split: int | None = None,
    unsupported: Mapping[str, str] | None = None,
    alignment: int | None = None,
    split_experts: bool = False,
) -> Path:
    """Write ``model_dir`` (a make_tiny_model directory) as GGUF; return the file's path.

    ``tensor_type``: the type of every 2-D weight (:data:`SUPPORTED_TYPES`); 1-D tensors stay
    F32. ``tokenizer=False`` writes no ``tokenizer.*`` metadata. ``architecture`` overrides
    ``general.architecture`` (and the prefix of the hyperparameter keys, as a converter for
    that architecture would write them; tensors are named as for the model's own
    architecture). ``split=N`` writes N files ``<stem>-0000i-of-0000N.gguf`` next to
    ``out_path`` with llama.cpp's split metadata (``split.no`` 0-based, ``split.count``,
    ``split.tensors.count`` in every file; all other metadata in the first), tensors in file
    order spread evenly, and returns the first file's path. ``unsupported`` maps GGUF tensor
    names (2-D weights) to another ggml type name to write them in (e.g.
    ``{"blk.0.ffn_up.weight": "IQ4_NL"}``): any type gguf-py can quantize, or IQ4_NL,
    IQ4_XS, or Q8_K (a type no loader takes as a weight).
    ``alignment``: a ``general.alignment`` other than the default 32 (tensor data aligned to it).
    ``split_experts``: each expert's matrices as tensors of their own, ``blk.N.ffn_gate.E``,
    as llama.cpp wrote Mixtral before its stacked ``ffn_gate_exps`` (and still reads).
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    if tensor_type not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor_type {tensor_type!r}; expected one of {SUPPORTED_TYPES}")
    config = _read_json(model_dir / "config.json")
    model_type = config["model_type"]
    if model_type not in MODEL_ARCHS:
        raise ValueError(f"unknown model_type {model_type!r}")
    arch_name = architecture or gguf.MODEL_ARCH_NAMES[MODEL_ARCHS[model_type]]
    tensors = gguf_tensors(model_dir)
    if split_experts:
        tensors = per_expert_tensors(tensors)
    unsupported = dict(unsupported or {})
    if missing := set(unsupported) - {n for n, t in tensors.items() if t.ndim == 2}:
        raise ValueError(f"unsupported= names no 2-D weight: {sorted(missing)}")
    if split is not None and not 1 <= split <= len(tensors):
        raise ValueError(f"split must be in 1..{len(tensors)}, got {split}")

    writer = gguf.GGUFWriter(path=None, arch=arch_name)
    # general.* (llama.cpp's prepare_metadata: type, then the model card's name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_dir.name)
    # TextModel.set_gguf_parameters (+ LlamaModel's additions)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if model_type != "gemma2":  # Gemma2Model writes none (llama.cpp's default base, 10000)
        writer.add_rope_freq_base(rope_theta(config))
    # (Gemma 3: its global layers' scaling, transformers 5's per-layer-type form)
    scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {}).get("full_attention") or {}
    if scaling.get("rope_type", scaling.get("type")) in ("linear", "yarn"):  # as TextModel writes them
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling.get("rope_type", scaling.get("type"))))
        writer.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if (head_dim := config.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(FILE_TYPES[tensor_type])
    write_family_metadata(writer, config)
    if model_type in PERMUTED:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim or config["hidden_size"] // config["num_attention_heads"])
    if tokenizer:
        _write_tokenizer(writer, model_dir, model_type, config["vocab_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if alignment is not None:
        writer.add_custom_alignment(alignment)

    names = list(tensors)
    starts = set()
    if split and split > 1:
        bounds = np.linspace(0, len(names), split + 1).round().astype(int)
        starts = set(bounds[1:-1].tolist())
    for i, name in enumerate(names):
        data = tensors[name]
        if i in starts:
            writer.tensors.append({})  # the next shard, as GGUFWriter's own split_max_* do
        if data.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            type_name = "F32"  # llama.cpp keeps 1-D tensors, norms and MoE routers in F32
        else:
            type_name = unsupported.get(name, tensor_type)
        writer.add_tensor(name, quantize(data, type_name), raw_dtype=QT[type_name])

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split and split > 1:
        paths = shard_paths(out_path, split)
        assert all(p.is_file() for p in paths), paths
        return paths[0]
    return out_path
