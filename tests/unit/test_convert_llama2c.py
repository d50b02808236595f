"""Tests for tandem.tools.convert_llama2c on the real stories260K checkpoint.

The reference implementations of llama2.c's tokenizer ``encode`` and of its
transformer forward (interleaved-pair RoPE) below are written from llama2.c's
run.c and read the .bin files directly, independently of the converter. The files are
the copy shipped in assets/stories260K (see tandem.tools.paths).
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from tandem.tools.convert_llama2c import convert_llama2c, permute_rotary
from tandem.tools.paths import stories260k_dir

STORIES = stories260k_dir()

SPECIAL_TEXTS = ("<s>", "</s>", "<unk>")
HYPOTHESIS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- llama2.c reference


def read_llama2c_tokenizer(path: Path, vocab_size: int = 512) -> tuple[list[str], list[float]]:
    data = path.read_bytes()
    offset, pieces, scores = 4, [], []
    for _ in range(vocab_size):
        score, length = struct.unpack_from("<fi", data, offset)
        pieces.append(data[offset + 8 : offset + 8 + length].decode("utf-8"))
        scores.append(score)
        offset += 8 + length
    return pieces, scores


def llama2c_encode(text: str, pieces: list[str], scores: list[float]) -> list[int]:
    """run.c's encode(text, bos=1, eos=0)."""
    lookup = {piece: i for i, piece in enumerate(pieces)}
    tokens = [1]
    if text:
        tokens.append(lookup[" "])  # dummy prefix
    for ch in text:
        if ch in lookup:
            tokens.append(lookup[ch])
        else:
            tokens.extend(byte + 3 for byte in ch.encode("utf-8"))
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged_id = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if merged_id is not None and scores[merged_id] > best_score:
                best_score, best_id, best_idx = scores[merged_id], merged_id, i
        if best_idx == -1:
            return tokens
        tokens[best_idx : best_idx + 2] = [best_id]


def read_llama2c_checkpoint(path: Path) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    data = path.read_bytes()
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    cfg = dict(zip(names, struct.unpack_from("<7i", data, 0)))
    dim, hidden, layers, vocab = cfg["dim"], cfg["hidden_dim"], cfg["n_layers"], abs(cfg["vocab_size"])
    head_size = dim // cfg["n_heads"]
    kv_dim = cfg["n_kv_heads"] * head_size
    floats = np.frombuffer(data, dtype="<f4", offset=28).astype(np.float64)
    w, offset = {}, 0
    for name, shape in [
        ("emb", (vocab, dim)),
        ("att_norm", (layers, dim)),
        ("wq", (layers, dim, dim)),
        ("wk", (layers, kv_dim, dim)),
        ("wv", (layers, kv_dim, dim)),
        ("wo", (layers, dim, dim)),
        ("ffn_norm", (layers, dim)),
        ("w1", (layers, hidden, dim)),
        ("w2", (layers, dim, hidden)),
        ("w3", (layers, hidden, dim)),
        ("final_norm", (dim,)),
    ]:
        size = int(np.prod(shape))
        w[name] = floats[offset : offset + size].reshape(shape)
        offset += size
    offset += cfg["seq_len"] * head_size  # two legacy RoPE tables
    w["cls"] = w["emb"] if cfg["vocab_size"] > 0 else floats[offset : offset + vocab * dim].reshape(vocab, dim)
    return cfg, w


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight


def _rope_interleaved(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of each head by pos * 10000^(-2i/head_size), as run.c does."""
    seq, width = x.shape
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    head_dim = torch.arange(0, width, 2, dtype=torch.float64) % head_size
    angle = pos * (1.0 / 10000.0 ** (head_dim / head_size))
    cos, sin = torch.cos(angle), torch.sin(angle)
    v0, v1 = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = v0 * cos - v1 * sin
    out[:, 1::2] = v0 * sin + v1 * cos
    return out


def llama2c_forward(path: Path, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of run.c's forward, float64."""
    cfg, npw = read_llama2c_checkpoint(path)
    w = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in npw.items()}
    n_heads, n_kv = cfg["n_heads"], cfg["n_kv_heads"]
    head_size = cfg["dim"] // n_heads
    seq = len(tokens)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = w["emb"][torch.tensor(tokens)]
    for layer in range(cfg["n_layers"]):
        xb = _rmsnorm(x, w["att_norm"][layer])
        q = _rope_interleaved(xb @ w["wq"][layer].T, head_size)
        k = _rope_interleaved(xb @ w["wk"][layer].T, head_size)
        v = xb @ w["wv"][layer].T
        heads = []
        for h in range(n_heads):
            kv_h = h // (n_heads // n_kv)
            qh = q[:, h * head_size : (h + 1) * head_size]
            kh = k[:, kv_h * head_size : (kv_h + 1) * head_size]
            vh = v[:, kv_h * head_size : (kv_h + 1) * head_size]
            att = (qh @ kh.T / math.sqrt(head_size)).masked_fill(~causal, float("-inf")).softmax(-1)
            heads.append(att @ vh)
        x = x + torch.cat(heads, dim=-1) @ w["wo"][layer].T
        xb = _rmsnorm(x, w["ffn_norm"][layer])
        hidden = torch.nn.functional.silu(xb @ w["w1"][layer].T) * (xb @ w["w3"][layer].T)
        x = x + hidden @ w["w2"][layer].T
    return _rmsnorm(x, w["final_norm"]) @ w["cls"].T


def llama2c_export_permute_reverse(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama2.c export.py's permute_reverse (HF layout -> llama2.c layout)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stories260K_hf")
    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[float]]:
    return read_llama2c_tokenizer(STORIES / "tok512.bin")


@pytest.fixture(scope="module")
def hf_tokenizer(converted):
    return AutoTokenizer.from_pretrained(converted)


@pytest.fixture(scope="module")
def raw_tokenizer(converted) -> Tokenizer:
    return Tokenizer.from_file(str(converted / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model(converted) -> LlamaForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    return model.eval()


# ----------------------------------------------------------------------------- files and weights


def test_config(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 172, 5)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 4, 8)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (512, 512)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["tie_word_embeddings"]) == (10000.0, 1e-5, True)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, "float32")
    gen = json.loads((converted / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, [2, 1])


def test_safetensors_names_tied(converted):
    tensors = load_file(str(converted / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    assert len(tensors) == 2 + 9 * 5
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.layers.4.self_attn.k_proj.weight"].shape == (32, 64)


def test_hf_loads_without_missing_or_unexpected_weights(converted):
    model, info = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_rotary_permutation_inverts_llama2c_export():
    w = torch.randn(32, 64)
    assert torch.equal(llama2c_export_permute_reverse(permute_rotary(w, 4), 4), w)
    assert torch.equal(permute_rotary(llama2c_export_permute_reverse(w, 4), 4), w)


def test_logits_match_llama2c_forward(hf_model, hf_tokenizer):
    tokens = hf_tokenizer("Once upon a time, there was a little dog named Max. He liked to run").input_ids
    tokens += [13, 403, 260, 3, 258, 511]  # a newline byte, arbitrary pieces, extreme ids
    expected = llama2c_forward(STORIES / "stories260K.bin", tokens)
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].double()
    assert logits.shape == expected.shape == (len(tokens), 512)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_greedy_generation_is_english(hf_model, hf_tokenizer):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([[1]]), max_new_tokens=80, do_sample=False, pad_token_id=0, eos_token_id=2)
    text = hf_tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith("Once upon a time"), text
    assert " the " in text and " was " in text


def test_cli(tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.tools.convert_llama2c",
            "--checkpoint",
            str(STORIES / "stories260K.bin"),
            "--tokenizer",
            str(STORIES / "tok512.bin"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


# ----------------------------------------------------------------------------- tokenizer

FIXED_STRINGS = [
    "",
    " ",
    "Once upon a time",
    "  two spaces",
    "日本語 😀",
    "Hello, world!",
    "a\nb\tc",
    "The cat sat on the mat.",
    "Lily's mom said, \"Let's go!\"",
    "    ",
    "aaaaaaaa",
    "é ñ – … €™",
    "tt tt tt ttt",
    "\u200a\xa0",
    "<0x41> <unk",
    "1234567890",
]


def _is_plain_text(text: str) -> bool:
    """Excludes the SentencePiece space marker and special-token strings, which HF maps specially."""
    return "\u2581" not in text and not any(s in text for s in SPECIAL_TEXTS)


UNICODE_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80).filter(_is_plain_text)
STORY_ALPHABET_TEXT = st.text(alphabet=" aeinostTLl.,'\n!h", max_size=120)


@pytest.fixture(scope="module")
def piece_text(vocab):
    pieces = [p for p in vocab[0][259:] if _is_plain_text(p)]
    return st.lists(st.sampled_from(pieces), max_size=25).map("".join)


def test_hf_tokenizer_class_and_bos(hf_tokenizer):
    assert hf_tokenizer("hi").input_ids[0] == 1
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.unk_token_id) == (1, 2, 0)
    assert len(hf_tokenizer) == 512


@pytest.mark.parametrize("text", FIXED_STRINGS)
def test_encode_matches_llama2c_fixed(hf_tokenizer, raw_tokenizer, vocab, text):
    expected = llama2c_encode(text, *vocab)
    assert hf_tokenizer(text).input_ids == expected
    assert raw_tokenizer.encode(text).ids == expected
    assert hf_tokenizer.decode(expected, skip_special_tokens=True) == text


def _check_encode_decode(hf_tokenizer, raw_tokenizer, vocab, text):
    expected = llama2c_encode(text, *vocab)
    assert raw_tokenizer.encode(text).ids == expected
    assert hf_tokenizer(text).input_ids == expected
    assert hf_tokenizer.decode(expected, skip_special_tokens=True) == text
    assert raw_tokenizer.decode(expected) == text


@HYPOTHESIS
@given(text=UNICODE_TEXT)
def test_encode_matches_llama2c_unicode(hf_tokenizer, raw_tokenizer, vocab, text):
    _check_encode_decode(hf_tokenizer, raw_tokenizer, vocab, text)


@HYPOTHESIS
@given(text=STORY_ALPHABET_TEXT)
def test_encode_matches_llama2c_story_alphabet(hf_tokenizer, raw_tokenizer, vocab, text):
    _check_encode_decode(hf_tokenizer, raw_tokenizer, vocab, text)


@HYPOTHESIS
@given(data=st.data())
def test_encode_matches_llama2c_vocab_pieces(hf_tokenizer, raw_tokenizer, vocab, piece_text, data):
    _check_encode_decode(hf_tokenizer, raw_tokenizer, vocab, data.draw(piece_text))
