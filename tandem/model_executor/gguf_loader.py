"""GGUF model files (llama.cpp's format): config, tokenizer and weights from one file or
a split set, read with the `gguf` package (ggml's own reader).

- `find_gguf_files(path)`: the file(s) that `--model-path` names: a `.gguf` file, a
  directory holding one model, or the first file of a split set (`-00001-of-0000N.gguf`).
- `gguf_model_dir(path)`: a Hugging Face style directory (config.json, tokenizer files,
  chat template) built once from the file's metadata and cached, so that every process
  reads the config and tokenizer quickly (GGUFReader parses all metadata on open: about
  3 s for a 49k-token vocabulary, and transformers' tokenizer conversion as long again).
- `iterate_gguf_weights(path)`: (Hugging Face name, `GGUFWeight`) for every tensor.

Weights stay in their file's blocks until a layer reads them: `GGUFWeight` keeps the raw
block bytes (rows of the output dimension, in Hugging Face order: llama.cpp's Q/K row
permutation of llama-architecture files is undone on the rows, which quantized blocks
allow since a block never spans rows), and indexing it dequantizes with gguf's vectorised
numpy code, as a safetensors slice reads, so the existing weight loaders take it as is
(`tandem.layers.weight_shard`). A layer that keeps blocks quantized reads `.blocks`.

Families (`FAMILIES`, by `general.architecture`; Mixtral is `llama` with expert tensors):
each maps llama.cpp's tensor names to its model's (`LAYER_NAMES`, a family's own
`layer_names`), adds the config fields of its features from its metadata keys and from
what llama.cpp fixes for it without a key (`GGUFMetadata.add_*_config`), and changes the
tensors its model takes otherwise (`family_tensors`: Gemma's stored `1 + w` norms, Phi-3's
fused rows split, a shared-expert gate's shape). Expert stacks ([experts, out, in]) are
yielded whole; `FusedMoE` takes each expert's rows of blocks from them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

# gguf's GGUFReader, quantization types and numpy dequantization.
import gguf
import numpy as np
import torch
from tqdm import tqdm

from tandem.layers.quantization.gguf_repack import SUPPORTED_QTYPES
from tandem.layers.weight_shard import CheckpointTensor

logger = logging.getLogger(__name__)

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf's numpy code dequantizes `qtype` (one block of zeros tried)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# Weight types a file may hold: floats, and every quantized type gguf's numpy code
# dequantizes (the integer tensor types are not weights). Those with a layout of Tandem's
# kernels stay quantized (`gguf_repack`); the others (the IQ and ternary types, MXFP4, ...)
# are dequantized at load to the serving dtype, said in one log line. Any other type stops
# the start in one line.
FLOAT_TYPES = frozenset(gguf.GGMLQuantizationType[n] for n in ("F32", "F16", "BF16"))
SUPPORTED_TYPES = FLOAT_TYPES | frozenset(
    t
    for t in gguf.GGMLQuantizationType
    if t not in FLOAT_TYPES and not t.name.startswith(("I8", "I16", "I32", "I64", "F64")) and _dequantizable(t)
)


@dataclass(frozen=True)
class Family:
    """How a GGUF architecture maps onto a Hugging Face one."""

    architecture: str  # the Hugging Face class, in models/registry.ARCHITECTURES
    model_type: str
    permute_qk: bool  # llama.cpp's converter permuted Q/K rows for its rotary layout
    layer_names: tuple[tuple[str, str], ...] = ()  # this family's own llama.cpp -> Hugging Face layer names
    norm_plus_one: bool = False  # the converter stored Gemma's RMSNorm weights as 1 + w


# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feedforward one there.
GEMMA_NAMES = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)
# general.architecture -> family; a family that Tandem adds comes with its GGUF name.
# Mixtral's files say "llama" with expert tensors (`GGUFMetadata` tells them apart).
FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", permute_qk=False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", permute_qk=False),
    "gemma2": Family("Gemma2ForCausalLM", "gemma2", permute_qk=False, layer_names=GEMMA_NAMES, norm_plus_one=True),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", permute_qk=False, layer_names=GEMMA_NAMES, norm_plus_one=True),
    "phi3": Family("Phi3ForCausalLM", "phi3", permute_qk=False),
    "qwen2moe": Family("Qwen2MoeForCausalLM", "qwen2_moe", permute_qk=False),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", permute_qk=False),
}
MIXTRAL = Family("MixtralForCausalLM", "mixtral", permute_qk=True)

# llama.cpp tensor names -> Hugging Face names (blk.N.<part> -> model.layers.N.<part>).
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v (split at load)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",  # Phi-3's holds gate and up (split at load)
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, every expert's matrix stacked [experts, out, in]
    # (`FusedMoE` takes the stacks whole), the shared expert and its gate (Qwen2-MoE)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# llama.cpp's files from before its stacked expert tensors (spring 2024; Mixtral's early
# files): one tensor per expert, blk.N.ffn_gate.E -> model.layers.N.mlp.experts.E.gate_proj.
EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Tensors a converter writes that the model does not take as weights, read into the
# config instead: rope_freqs (the rotary frequency divisors of Llama 3.x scaling) and
# Phi-3's longrope factors.
SKIPPED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def is_gguf_path(path: str) -> bool:
    """Whether `--model-path` names GGUF (a .gguf file, or a directory holding only GGUF
    weights: no config.json)."""
    if path.endswith(".gguf"):
        return True
    return (
        os.path.isdir(path)
        and not os.path.isfile(os.path.join(path, "config.json"))
        and bool(glob.glob(os.path.join(path, "*.gguf")))
    )


def find_gguf_files(path: str) -> list[str]:
    """The GGUF file(s) of one model, the first (which holds the metadata) first;
    ValueError naming what is missing or ambiguous."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "*.gguf")))
        firsts = [
            f
            for f in found
            if not SPLIT_RE.match(os.path.basename(f)) or SPLIT_RE.match(os.path.basename(f))["no"] == "00001"
        ]
        if len(firsts) != 1:
            names = ", ".join(os.path.basename(f) for f in firsts) or "none"
            raise ValueError(
                f"--model-path: {path!r} must hold exactly one GGUF model (found: {names}); name the .gguf file"
            )
        path = firsts[0]
    if not os.path.isfile(path):
        raise ValueError(f"--model-path: no such GGUF file {path!r}")
    match = SPLIT_RE.match(os.path.basename(path))
    if match is None:
        return [path]
    if match["no"] != "00001":
        raise ValueError(
            f"--model-path: {path!r} is part {int(match['no'])} of a split GGUF set; "
            "name the first part (-00001-of-...)"
        )
    count = int(match["count"])
    stem = os.path.join(os.path.dirname(path), match["stem"])
    files = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"--model-path: split GGUF set {os.path.basename(path)!r} lacks {', '.join(missing)}")
    return files


def open_reader(path: str) -> gguf.GGUFReader:
    """GGUFReader over `path`; ValueError (one line) for a file that is not valid GGUF."""
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the reader raises several kinds for a bad file
        size = os.path.getsize(path)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "magic" in reason.lower():
            reason = "not a GGUF file (wrong magic number)"
        else:
            reason = f"truncated or corrupt ({size} bytes; the reader said: {reason})"
        raise ValueError(f"--model-path: {path!r} is {reason}") from None


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class GGUFMetadata:
    """The metadata and tensor list of one model's GGUF file(s)."""

    def __init__(self, path: str):
        self.files = find_gguf_files(path)
        self.readers = [open_reader(f) for f in self.files]
        self.reader = self.readers[0]
        self.arch = field_value(self.reader, "general.architecture")
        if self.arch not in FAMILIES:
            raise ValueError(
                f"--model-path: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(sorted(FAMILIES))})"
            )
        self.family = FAMILIES[self.arch]
        if self.arch == "llama" and self.arch_value("expert_count"):  # Mixtral's files say "llama" too
            self.family = MIXTRAL
        self.tensors = [t for r in self.readers for t in r.tensors]
        self.tensor_by_name = {t.name: t for t in self.tensors}
        for t in self.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"--model-path: tensor {t.name!r} has GGUF type {t.tensor_type.name}, "
                    "which gguf cannot dequantize and Tandem cannot load (supported: "
                    f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            # Here, not at load: a file that cannot load stops the start in one line.
            if t.name not in SKIPPED_TENSORS and hf_name(t.name, self.family) is None:
                raise ValueError(f"--model-path: unexpected tensor {t.name!r} in the GGUF file")

    def arch_value(self, key: str, default=None):
        return field_value(self.reader, f"{self.arch}.{key}", default)

    def head_dim(self) -> int:
        heads = int(self.arch_value("attention.head_count"))
        return int(self.arch_value("attention.key_length", int(self.arch_value("embedding_length")) // heads))

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGUF type the file holds."""
        return dict(Counter(t.tensor_type.name for t in self.tensors).most_common())

    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self.reader.fields and "tokenizer.ggml.tokens" in self.reader.fields

    def config_dict(self) -> dict:
        """A Hugging Face config.json for the model, from the metadata."""
        heads = int(self.arch_value("attention.head_count"))
        hidden = int(self.arch_value("embedding_length"))
        embed = next(t for t in self.tensors if t.name == "token_embd.weight")
        output = next((t for t in self.tensors if t.name == "output.weight"), None)
        vocab = self.arch_value("vocab_size") or int(embed.shape[-1])
        config = {
            "architectures": [self.family.architecture],
            "model_type": self.family.model_type,
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_value("feed_forward_length")),
            "num_hidden_layers": int(self.arch_value("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_value("attention.head_count_kv", heads)),
            "head_dim": self.head_dim(),
            "max_position_embeddings": int(self.arch_value("context_length", 2048)),
            "rms_norm_eps": float(self.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_value("rope.freq_base", 10000.0)),
            "vocab_size": int(vocab),
            # Tied without a head, or with one that copies the embedding (some Qwen2 files
            # carry it): one matrix, as in the model's Hugging Face config.
            "tie_word_embeddings": output is None
            or (output.tensor_type == embed.tensor_type and np.array_equal(output.data, embed.data)),
            # Served in bfloat16 where the CPU has it unless every weight is float32
            # (model_runner.resolve_dtype, as for a half-precision checkpoint).
            "torch_dtype": "float32" if set(self.tensor_types()) == {"F32"} else "bfloat16",
            "gguf": {"files": [os.path.basename(f) for f in self.files], "tensor_types": self.tensor_types()},
        }
        scaling = self.rope_scaling()
        if scaling:
            config["rope_scaling"] = scaling
        self.add_family_config(config)
        factors = next((t for t in self.tensors if t.name == "rope_freqs.weight"), None)
        if factors is not None:  # Llama 3.x scaling, as llama.cpp's converter stores it
            config["rope_freq_factors"] = [float(f) for f in gguf.quants.dequantize(factors.data, factors.tensor_type)]
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = field_value(self.reader, f"tokenizer.ggml.{key}")
            if value is not None:
                config[key.replace("padding", "pad")] = int(value)
        return config

    def add_family_config(self, config: dict) -> None:
        """The config fields of the family's own features, from its metadata keys and what
        llama.cpp fixes for the family where the file says nothing."""
        kind = self.family.model_type
        if kind in ("gemma2", "gemma3_text"):
            self.add_gemma_config(config)
        elif kind == "phi3":
            self.add_phi3_config(config)
        if self.arch_value("expert_count"):
            self.add_moe_config(config)
        has_bias = "blk.0.attn_q.bias" in self.tensor_by_name
        config["qkv_bias" if kind == "qwen2_moe" else "attention_bias"] = has_bias

    def add_gemma_config(self, config: dict) -> None:
        """Gemma 2/3: soft-caps and window from the metadata; as llama.cpp: the sliding
        layers every other one (Gemma 2) or five of six (Gemma 3) unless the file gives its
        `sliding_window_pattern`, the scores scaled by head_dim ** -0.5 except on the 27B
        models ((hidden / heads) ** -0.5; their layer counts, 46 and 62, tell them), Gemma
        3's sliding layers rotating with base 10000."""
        gemma2 = self.family.model_type == "gemma2"
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        window = int(self.arch_value("attention.sliding_window", 0) or 0)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = self.arch_value(key)
            config[key] = float(value) if value else None
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["sliding_window"] = window or None
        large = layers == (46 if gemma2 else 62)
        config["query_pre_attn_scalar"] = config["hidden_size"] // heads if large else config["head_dim"]
        pattern = self.arch_value("attention.sliding_window_pattern", 2 if gemma2 else 6)
        sliding = (
            [bool(p) for p in pattern]
            if isinstance(pattern, list)
            else [i % pattern < pattern - 1 for i in range(layers)]
        )
        config["layer_types"] = ["sliding_attention" if s and window else "full_attention" for s in sliding]
        if not gemma2:  # transformers 5's per-layer-type RoPE
            full = {"rope_type": "default", **(config.pop("rope_scaling", None) or {})}
            full["rope_theta"] = config.pop("rope_theta")
            config["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            }

    def add_phi3_config(self, config: dict) -> None:
        """Phi-3: window and rotary width from the metadata, the 128k models' longrope
        factors from their tensors (`rope_factors_long` / `_short`)."""
        window = int(self.arch_value("attention.sliding_window", 0) or 0)
        config["sliding_window"] = window or None
        rope_dims = int(self.arch_value("rope.dimension_count", config["head_dim"]))
        if rope_dims != config["head_dim"]:
            config["partial_rotary_factor"] = rope_dims / config["head_dim"]
        original = self.arch_value("rope.scaling.original_context_length")
        if original:
            config["original_max_position_embeddings"] = int(original)
        long, short = (self.tensor_by_name.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
        if long is not None and short is not None:
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": [float(f) for f in gguf.quants.dequantize(long.data, long.tensor_type)],
                "short_factor": [float(f) for f in gguf.quants.dequantize(short.data, short.tensor_type)],
            }

    def add_moe_config(self, config: dict) -> None:
        """Mixtral, Qwen2-MoE, Qwen3-MoE: expert counts and sizes from the metadata; a layer
        without a router (`ffn_gate_inp`) is dense (`mlp_only_layers`); the top-k weights
        renormalized as llama.cpp does (`expert_weights_norm`, else Qwen3-MoE yes and
        Qwen2-MoE no)."""
        kind = self.family.model_type
        experts = int(self.arch_value("expert_count"))
        config["num_experts_per_tok"] = int(self.arch_value("expert_used_count"))
        if kind == "mixtral":
            config["num_local_experts"] = experts
            config["sliding_window"] = None
            return
        down = next(t for t in self.tensors if t.name.endswith(".ffn_down_exps.weight"))
        config["num_experts"] = experts
        config["moe_intermediate_size"] = int(self.arch_value("expert_feed_forward_length", down.shape[0]))
        layers = config["num_hidden_layers"]
        config["mlp_only_layers"] = [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in self.tensor_by_name
        ]
        config["decoder_sparse_step"] = 1
        norm = self.arch_value("expert_weights_norm")
        config["norm_topk_prob"] = bool(norm) if norm is not None else kind == "qwen3_moe"
        shared = next((t for t in self.tensors if t.name.endswith(".ffn_down_shexp.weight")), None)
        if shared is not None:
            size = self.arch_value("expert_shared_feed_forward_length", shared.shape[0])
            config["shared_expert_intermediate_size"] = int(size)

    def rope_scaling(self) -> dict | None:
        kind = self.arch_value("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":  # GGUF's other kinds: yarn, longrope
            raise ValueError(f"--model-path: the GGUF file's RoPE scaling {kind!r} is not supported yet (only linear)")
        scaling = {"rope_type": kind, "factor": float(self.arch_value("rope.scaling.factor", 1.0))}
        original = self.arch_value("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling


def _cache_root() -> str:
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


# Bumped when what gguf_model_dir writes changes.
CACHE_LAYOUT = 3


def _cache_key(path: str) -> str:
    """Names the file (path, size, mtime) and what builds its view (transformers builds the
    tokenizer; CACHE_LAYOUT the rest)."""
    import transformers

    first = os.path.realpath(find_gguf_files(path)[0])
    stat = os.stat(first)
    parts = (first, stat.st_size, stat.st_mtime_ns, transformers.__version__, CACHE_LAYOUT)
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def gguf_model_dir(path: str, need_tokenizer: bool = True) -> str:
    """The cached Hugging Face style directory of the GGUF model at `path` (built on first
    use: config.json, and the tokenizer transformers builds from the metadata, with its
    chat template); ValueError for a bad or unsupported file, or, with `need_tokenizer`,
    one without tokenizer metadata."""
    key = _cache_key(path)
    for root in (_cache_root(), os.path.join(tempfile.gettempdir(), "tandem-cache")):
        target = os.path.join(root, "gguf", key)
        if os.path.isfile(os.path.join(target, "config.json")):
            break
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        except OSError:
            continue
        _build_model_dir(path, target)
        break
    if need_tokenizer and not os.path.isfile(os.path.join(target, "tokenizer.json")):
        raise ValueError(
            f"--model-path: the GGUF file {find_gguf_files(path)[0]!r} has no tokenizer metadata; "
            "pass --tokenizer-path (or --skip-tokenizer-init)"
        )
    return target


def hf_view(path: str, need_tokenizer: bool = True) -> str:
    """`path` itself for a Hugging Face directory; for a GGUF path its cached Hugging Face
    style directory (`gguf_model_dir`): what the config and tokenizer loaders read."""
    return gguf_model_dir(path, need_tokenizer) if is_gguf_path(path) else path


def _build_model_dir(path: str, target: str) -> None:
    meta = GGUFMetadata(path)
    work = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".building-")
    try:
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(meta.config_dict(), f, indent=1)
        if meta.has_tokenizer():
            from transformers import AutoTokenizer

            first = meta.files[0]
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(first) or ".", gguf_file=os.path.basename(first))
            tokenizer.save_pretrained(work)
        try:
            os.rename(work, target)  # atomic: another process may have built it meanwhile
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


class GGUFWeight:
    """One tensor of a GGUF file in Hugging Face layout ([out, in] for matrices), still in
    its file's blocks (`blocks`: a uint8 array of one row of blocks per output row, or the
    plain float array for F32/F16); indexing dequantizes, to float32, like a safetensors
    slice reads."""

    def __init__(self, blocks: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]):
        self.blocks, self.qtype, self.shape = blocks, qtype, tuple(shape)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The tensor (or, for a matrix, `rows` of it) in float32."""
        blocks = self.blocks if rows == slice(None) else self.blocks[rows]
        values = np.ascontiguousarray(gguf.quants.dequantize(blocks, self.qtype), dtype=np.float32)
        if not values.flags.writeable:  # F32 tensors come straight from the file's memory map
            values = values.copy()
        return torch.from_numpy(values).reshape(-1, *self.shape[1:])

    def part(self, index: int) -> GGUFWeight:
        """Entry `index` of a stacked tensor (one expert's matrix of [experts, out, in]), still in blocks."""
        return GGUFWeight(self.blocks[index], self.qtype, self.shape[1:])

    def __getitem__(self, index) -> torch.Tensor:
        """A row slice of a matrix dequantizes only those rows (a tensor-parallel rank's
        shard of the embedding, the head, a column-split layer), as a safetensors slice
        reads only its rows; anything else dequantizes the whole tensor first."""
        index = index if isinstance(index, tuple) else (index,)
        if len(self.shape) >= 2 and index and isinstance(index[0], slice) and len(self.blocks) == self.shape[0]:
            return self.dequantize(index[0])[(slice(None),) + index[1:]]
        return self.dequantize()[index]


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` (its rotary pairs (i, i + d/2) made adjacent) on the
    first axis: rows of floats or of quantized blocks alike."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_name(gguf_name: str, family: Family) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name (None: not a weight)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    names = {**LAYER_NAMES, **dict(family.layer_names)}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_NAMES and parts[3].isdigit():
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{EXPERT_NAMES[parts[2]]}.{suffix}"
    return None


def split_rows(weight: GGUFWeight, parts: list[tuple[str, int]]) -> Iterator[tuple[str, GGUFWeight]]:
    """A fused tensor's row ranges as tensors of their own: `parts` (name, rows) in row
    order. Rows of blocks stay blocks."""
    start = 0
    for name, rows in parts:
        yield name, GGUFWeight(weight.blocks[start : start + rows], weight.qtype, (rows, *weight.shape[1:]))
        start += rows


def family_tensors(meta: GGUFMetadata, name: str, weight: GGUFWeight) -> Iterator[tuple[str, CheckpointTensor]]:
    """(Hugging Face name, tensor) of one file tensor as the family's model loads it:
    Gemma's stored `1 + w` norms back to `w` (its RMSNorm adds the 1), Phi-3's fused
    q/k/v and gate/up rows split into their parts (so that each keeps its blocks, and a
    tensor-parallel rank reads its own heads), Qwen2-MoE's shared-expert gate as the
    [1, hidden] matrix it is."""
    if meta.family.norm_plus_one and name.endswith("norm.weight"):
        yield name, weight.dequantize() - 1.0
    elif name.endswith(".self_attn.qkv_proj.weight"):
        head_dim = meta.head_dim()
        q = int(meta.arch_value("attention.head_count")) * head_dim
        kv = (weight.shape[0] - q) // 2
        prefix = name.removesuffix("qkv_proj.weight")
        yield from split_rows(weight, [(f"{prefix}{p}_proj.weight", n) for p, n in (("q", q), ("k", kv), ("v", kv))])
    elif meta.family.model_type == "phi3" and name.endswith(".mlp.up_proj.weight"):
        inter = weight.shape[0] // 2
        prefix = name.removesuffix("up_proj.weight")
        yield from split_rows(weight, [(f"{prefix}gate_proj.weight", inter), (f"{prefix}up_proj.weight", inter)])
    elif name.endswith(".mlp.shared_expert_gate.weight") and len(weight.shape) == 1:
        yield name, GGUFWeight(weight.blocks.reshape(1, -1), weight.qtype, (1, weight.shape[0]))
    else:
        yield name, weight


def iterate_gguf_weights(path: str, show_progress: bool = True) -> Iterator[tuple[str, GGUFWeight]]:
    """(Hugging Face name, GGUFWeight) for every weight tensor, with a progress bar
    (`GGUFMetadata` refused the files with a tensor that has no Hugging Face counterpart)."""
    meta = GGUFMetadata(path)
    slow = sorted(set(meta.tensor_types()) - {t.name for t in FLOAT_TYPES | SUPPORTED_QTYPES})
    if slow:
        logger.info(
            "GGUF tensors of type %s have no Tandem kernel yet: dequantized at load to the serving dtype "
            "(their layers multiply dense weights)",
            ", ".join(slow),
        )
    heads = int(meta.arch_value("attention.head_count"))
    kv_heads = int(meta.arch_value("attention.head_count_kv", heads))
    for t in tqdm(meta.tensors, desc="Loading GGUF tensors", disable=not show_progress, unit="tensor"):
        if t.name in SKIPPED_TENSORS:
            continue
        name = hf_name(t.name, meta.family)
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
        blocks = t.data
        if meta.family.permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):
            blocks = _unpermute_rows(blocks, heads if ".attn_q." in t.name else kv_heads)
        yield from family_tensors(meta, name, GGUFWeight(blocks, t.tensor_type, shape))
