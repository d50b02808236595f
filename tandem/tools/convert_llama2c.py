"""Convert a llama2.c checkpoint and tokenizer into a Hugging Face Llama directory.

Usage::

    python -m tandem.tools.convert_llama2c --checkpoint stories260K.bin \\
        --tokenizer tok512.bin --out DIR

or :func:`convert_llama2c` from Python. Input formats (Karpathy's llama2.c):

* checkpoint, legacy "v0" format: 7 int32 (dim, hidden_dim, n_layers,
  n_heads, n_kv_heads, vocab_size, seq_len), then fp32 arrays: token
  embedding, attention RMSNorm, wq, wk, wv, wo, FFN RMSNorm, w1, w2, w3, final
  RMSNorm, two unused legacy RoPE tables, and the classifier only when the
  header's vocab_size is negative (positive means it is tied to the embedding);
* tokenizer: int32 max_token_length, then per token a float32 score, an int32
  byte length and the piece's bytes (spaces stored as plain spaces; ids 0
  ``<unk>``, 1 BOS, 2 EOS, 3..258 the byte-fallback tokens ``<0x00>``..``<0xFF>``).

Output: ``config.json`` (flat "old" form, as in tandem.tools.make_tiny_model),
fp32 ``model.safetensors`` with Hugging Face names (no ``lm_head.weight`` when
tied), ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json``.

RoPE layout: llama2.c rotates interleaved pairs (2i, 2i+1) of each head,
Hugging Face Llama rotates the two halves. The rows of wq and wk are permuted
per head exactly as transformers' ``convert_llama_weights_to_hf.py`` does (the
inverse of llama2.c's ``export.py`` permutation), which makes the two forwards
equal.

Tokenizer: a SentencePiece-style BPE ``tokenizer.json`` that reproduces
llama2.c's ``encode``: BOS, a dummy-prefix space, one token per character
(unknown characters become UTF-8 byte tokens, id = byte + 3), then repeated
merging of the adjacent pair whose merged piece has the highest score. In
Hugging Face terms: spaces become ``"▁"``, merges are every split (a, b) of
every piece with both halves in the vocabulary, ranked by the merged piece's
score (llama2.c's scores are distinct, so the ranking is the same; only a
piece reachable by two overlapping splits at once, which llama2.c resolves by
position, could in principle differ). The decoder drops the dummy-prefix space.

BOS/EOS: llama2.c's own sampler stops when the model emits BOS (id 1), which
is how TinyStories separates stories. config.json keeps ``eos_token_id`` 2
(``</s>``) and ``bos_token_id`` 1, as for every Llama checkpoint, and
generation_config.json lists both 2 and 1 as EOS, so that transformers'
``generate`` and Tandem both end a story where llama2.c does.
"""

from __future__ import annotations

import argparse
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, processors

from tandem.tools.make_tiny_model import added_tokens_decoder

SPACE = "\u2581"  # "▁"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
NUM_SPECIAL = 3  # <unk>, <s>, </s>
NUM_BYTE_TOKENS = 256
FIRST_PIECE_ID = NUM_SPECIAL + NUM_BYTE_TOKENS  # 259
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0
LEGACY_MAGIC = 0x616B3432  # "ak42": llama2.c's versioned formats, not supported here


@dataclass(frozen=True)
class Llama2cConfig:
    """The 7-int header of a legacy llama2.c checkpoint."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # always positive here; see ``shared_classifier``
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size


# ----------------------------------------------------------------------------- checkpoint


def read_header(data: bytes) -> Llama2cConfig:
    """Parse the legacy header; raise ``ValueError`` for a versioned (``ak42``) file."""
    values = struct.unpack_from("<7i", data, 0)
    if values[0] == LEGACY_MAGIC:
        raise ValueError("versioned llama2.c checkpoint (magic 'ak42'); only the legacy v0 format is supported")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = values
    return Llama2cConfig(
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len, shared_classifier=vocab_size > 0
    )


def _array_shapes(cfg: Llama2cConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the fp32 arrays after the header, in file order."""
    L, d, h, kv = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.kv_dim
    shapes = [
        ("tok_embeddings", (cfg.vocab_size, d)),
        ("attention_norm", (L, d)),
        ("wq", (L, d, d)),
        ("wk", (L, kv, d)),
        ("wv", (L, kv, d)),
        ("wo", (L, d, d)),
        ("ffn_norm", (L, d)),
        ("w1", (L, h, d)),
        ("w2", (L, d, h)),
        ("w3", (L, h, d)),
        ("norm", (d,)),
        ("freq_cis_real", (cfg.seq_len, cfg.head_size // 2)),
        ("freq_cis_imag", (cfg.seq_len, cfg.head_size // 2)),
    ]
    if not cfg.shared_classifier:
        shapes.append(("output", (cfg.vocab_size, d)))
    return shapes


def read_checkpoint(path: str | Path) -> tuple[Llama2cConfig, dict[str, torch.Tensor]]:
    """Read a legacy llama2.c checkpoint into its config and llama2.c-named fp32 tensors."""
    data = Path(path).read_bytes()
    cfg = read_header(data)
    shapes = _array_shapes(cfg)
    n_floats = sum(int(np.prod(shape)) for _, shape in shapes)
    header_bytes = 7 * 4
    if len(data) != header_bytes + 4 * n_floats:
        raise ValueError(f"{path}: {len(data)} bytes, expected {header_bytes + 4 * n_floats} for header {cfg}")
    flat = torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=header_bytes).copy())
    tensors, offset = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        tensors[name] = flat[offset : offset + size].view(shape)
        offset += size
    return cfg, tensors


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved-pair RoPE (llama2.c) to rotate-half RoPE (HF)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state_dict(cfg: Llama2cConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map llama2.c tensors to Hugging Face ``LlamaForCausalLM`` names (fp32, contiguous)."""
    sd = {"model.embed_tokens.weight": t["tok_embeddings"], "model.norm.weight": t["norm"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t["attention_norm"][i]
        sd[p + "self_attn.q_proj.weight"] = permute_rotary(t["wq"][i], cfg.n_heads)
        sd[p + "self_attn.k_proj.weight"] = permute_rotary(t["wk"][i], cfg.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = t["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = t["wo"][i]
        sd[p + "post_attention_layernorm.weight"] = t["ffn_norm"][i]
        sd[p + "mlp.gate_proj.weight"] = t["w1"][i]
        sd[p + "mlp.down_proj.weight"] = t["w2"][i]
        sd[p + "mlp.up_proj.weight"] = t["w3"][i]
    if not cfg.shared_classifier:
        sd["lm_head.weight"] = t["output"]
    return {k: v.to(torch.float32).contiguous().clone() for k, v in sd.items()}


def hf_config(cfg: Llama2cConfig) -> dict:
    """Flat ("old" form) Llama config.json contents."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- tokenizer


def read_tokenizer(path: str | Path, vocab_size: int | None = None) -> tuple[list[str], list[float]]:
    """Read llama2.c's tokenizer.bin: pieces (as stored, UTF-8 decoded) and scores."""
    data = Path(path).read_bytes()
    offset = 4  # max_token_length, not needed
    pieces, scores = [], []
    while offset < len(data) and (vocab_size is None or len(pieces) < vocab_size):
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        pieces.append(data[offset : offset + length].decode("utf-8"))
        scores.append(score)
        offset += length
    return pieces, scores


def hf_vocab(pieces: list[str]) -> dict[str, int]:
    """Vocabulary in SentencePiece notation: "▁" for spaces, canonical special names."""
    vocab = {UNK: 0, BOS: 1, EOS: 2}
    for i in range(NUM_SPECIAL, NUM_SPECIAL + NUM_BYTE_TOKENS):
        vocab[f"<0x{i - NUM_SPECIAL:02X}>"] = i
    for i in range(FIRST_PIECE_ID, len(pieces)):
        vocab[pieces[i].replace(" ", SPACE)] = i
    return vocab


def hf_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split (a, b) of every learned piece with both halves learned pieces or
    characters, ranked by the merged piece's score (highest first); splits of one
    piece are ordered by the length of their left half."""
    learned = {piece: i for piece, i in vocab.items() if i >= FIRST_PIECE_ID}
    ranked = []
    for piece, piece_id in learned.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in learned and right in learned:
                ranked.append((-scores[piece_id], piece_id, k, (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def build_tokenizer(pieces: list[str], scores: list[float]) -> Tokenizer:
    """The Hugging Face ``tokenizers`` equivalent of llama2.c's encode/decode (adds BOS)."""
    vocab = hf_vocab(pieces)
    model = models.BPE(vocab=vocab, merges=hf_merges(vocab, scores), unk_token=UNK, byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens([UNK, BOS, EOS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 1)]
    )
    return tokenizer


def tokenizer_config(max_length: int) -> dict:
    added = added_tokens_decoder(enumerate((UNK, BOS, EOS)))
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }


# ----------------------------------------------------------------------------- driver


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_llama2c(checkpoint: str | Path, tokenizer: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama2.c checkpoint + tokenizer.bin into a Hugging Face Llama directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, tensors = read_checkpoint(checkpoint)
    pieces, scores = read_tokenizer(tokenizer, cfg.vocab_size)
    if len(pieces) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(pieces)} pieces, checkpoint vocab_size is {cfg.vocab_size}")

    save_file(to_hf_state_dict(cfg, tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(cfg))
    _write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2, 1]})
    build_tokenizer(pieces, scores).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(cfg.seq_len))
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a llama2.c checkpoint to a Hugging Face Llama directory.")
    parser.add_argument("--checkpoint", required=True, type=Path, help="llama2.c .bin checkpoint (legacy format)")
    parser.add_argument("--tokenizer", required=True, type=Path, help="llama2.c tokenizer .bin")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    print(convert_llama2c(args.checkpoint, args.tokenizer, args.out))


if __name__ == "__main__":
    main()
