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
"""

from __future__ import annotations

import glob
import hashlib
import json
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

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# Types dequantized at load (to the serving dtype); any other stops the start.
SUPPORTED_TYPES = frozenset(
    gguf.GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)


@dataclass(frozen=True)
class Family:
    """How a GGUF architecture maps onto a Hugging Face one."""

    architecture: str  # the Hugging Face class, in models/registry.ARCHITECTURES
    model_type: str
    permute_qk: bool  # llama.cpp's converter permuted Q/K rows for its rotary layout


# general.architecture -> family; a family that Tandem adds comes with its GGUF name.
FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", permute_qk=False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", permute_qk=False),
}

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors a converter writes that the model does not take as weights (rope_freqs: the
# rotary frequency divisors of Llama 3.x scaling, read into the config instead).
SKIPPED_TENSORS = {"rope_freqs.weight"}


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
        experts = self.arch_value("expert_count") or 0
        if experts:  # Mixtral's files say "llama" too
            raise ValueError(
                f"--model-path: the GGUF file is a mixture-of-experts model ({self.arch}.expert_count "
                f"{experts}), which Tandem cannot load"
            )
        self.tensors = [t for r in self.readers for t in r.tensors]
        for t in self.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"--model-path: tensor {t.name!r} has GGUF type {t.tensor_type.name}, "
                    "which Tandem cannot load (supported: "
                    f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            # Here, not at load: a file that cannot load stops the start in one line.
            if t.name not in SKIPPED_TENSORS and hf_name(t.name) is None:
                raise ValueError(f"--model-path: unexpected tensor {t.name!r} in the GGUF file")

    def arch_value(self, key: str, default=None):
        return field_value(self.reader, f"{self.arch}.{key}", default)

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
            "head_dim": int(self.arch_value("attention.key_length", hidden // heads)),
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
        factors = next((t for t in self.tensors if t.name == "rope_freqs.weight"), None)
        if factors is not None:  # Llama 3.x scaling, as llama.cpp's converter stores it
            config["rope_freq_factors"] = [float(f) for f in gguf.quants.dequantize(factors.data, factors.tensor_type)]
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = field_value(self.reader, f"tokenizer.ggml.{key}")
            if value is not None:
                config[key.replace("padding", "pad")] = int(value)
        return config

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
CACHE_LAYOUT = 2


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


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name (None: not a weight)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def iterate_gguf_weights(path: str, show_progress: bool = True) -> Iterator[tuple[str, GGUFWeight]]:
    """(Hugging Face name, GGUFWeight) for every weight tensor, with a progress bar
    (`GGUFMetadata` refused the files with a tensor that has no Hugging Face counterpart)."""
    meta = GGUFMetadata(path)
    heads = int(meta.arch_value("attention.head_count"))
    kv_heads = int(meta.arch_value("attention.head_count_kv", heads))
    for t in tqdm(meta.tensors, desc="Loading GGUF tensors", disable=not show_progress, unit="tensor"):
        if t.name in SKIPPED_TENSORS:
            continue
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
        blocks = t.data
        if meta.family.permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):
            blocks = _unpermute_rows(blocks, heads if ".attn_q." in t.name else kv_heads)
        yield name, GGUFWeight(blocks, t.tensor_type, shape)
