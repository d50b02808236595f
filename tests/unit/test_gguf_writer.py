"""The test helper tests/gguf_writer.py against transformers' own GGUF loader (not Tandem).

For make_tiny_model's llama, qwen2 and qwen3 (preset ``gguf``): the F32 file loads in
transformers with the same logits as the HF directory (so names, the llama Q/K permutation
and the config metadata are what llama.cpp's readers expect), its tokenizer encodes like
the directory's and keeps the chat template; every quantized type dequantizes (gguf-py's
dequantizer, which transformers uses) to within its expected error of the weights; split,
tokenizer-less, renamed-architecture and unsupported-type files are marked as llama.cpp
marks them.
"""

from __future__ import annotations

import gguf_writer
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf_writer import SUPPORTED_TYPES, dequantize, gguf_tensors, permute, quantize, shard_paths, write_gguf
from safetensors.numpy import load_file

from tandem.tools.make_tiny_model import _training_lines, make_tiny_model

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
PROMPT = [[1, 5, 9, 300, 301, 400, 17, 18, 900, 1000, 1200, 7, 7, 3]]

# Relative RMS error of a dequantized weight (gguf-py's dequantizer) against the original,
# per type. The round-to-nearest quantizers of gguf_writer give (worst tensor of the tiny
# Gaussian weights) F16 0.0002, BF16 0.0017, Q8_0 0.0054, Q6_K 0.019, Q5_1 0.038,
# Q5_K 0.038, Q5_0 0.043, Q4_1 0.078, Q4_K 0.079, Q4_0 0.086, Q3_K 0.155, Q2_K 0.33.
MAX_REL_RMS = {
    "F16": 5e-4,
    "BF16": 4e-3,
    "Q8_0": 0.012,
    "Q6_K": 0.04,
    "Q5_0": 0.09,
    "Q5_1": 0.08,
    "Q5_K": 0.08,
    "Q4_0": 0.17,
    "Q4_1": 0.16,
    "Q4_K": 0.16,
    "IQ4_NL": 0.16,
    "IQ4_XS": 0.16,
    "Q3_K": 0.3,
    "Q2_K": 0.45,
}
# ... and the least error a quantizer of that width can reach (catches a type silently
# written as something finer).
MIN_REL_RMS = {
    "Q8_0": 1e-3,
    "Q6_K": 5e-3,
    "Q5_0": 0.015,
    "Q5_1": 0.015,
    "Q5_K": 0.015,
    "Q4_0": 0.03,
    "Q4_1": 0.03,
    "Q4_K": 0.03,
    "IQ4_NL": 0.03,
    "IQ4_XS": 0.03,
    "Q3_K": 0.06,
    "Q2_K": 0.12,
}

# Texts the GGUF tokenizers must encode exactly like the HF directories' (none starts with
# a space or holds a special token: see test_llama_tokenizer_known_differences).
TEXTS = [
    "",
    "Hello, world!",
    "Once upon a time, in a small town by the sea",
    "a\nb\tc\r\n",
    "two  spaces  inside  ",
    "The 12 loaves cost $19.99 (per month).",
    "日本語 😀 café naïve",
    "x" * 50,
    "3.14159 and -42 appear everywhere!!!",
] + [line.strip() for line in _training_lines()]


def _field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf_models")
    return {arch: make_tiny_model(root / arch, arch=arch, preset="gguf") for arch in ARCHS}


@pytest.fixture(scope="module")
def f32_files(model_dirs, tmp_path_factory) -> dict:
    """One F32 file per arch, alone in its directory (so transformers reads only the GGUF)."""
    root = tmp_path_factory.mktemp("gguf_files")
    return {arch: write_gguf(path, root / arch / "model-f32.gguf") for arch, path in model_dirs.items()}


@pytest.fixture(scope="module")
def llama_tensors(model_dirs) -> dict:
    return gguf_tensors(model_dirs["llama"])


# ----------------------------------------------------------------------------- F32 vs transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(model_dirs, f32_files, arch):
    path = f32_files[arch]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(model.config, key) == getattr(ref.config, key), key
    assert model.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)  # a GGUF float32
    # (transformers reads no head size from a qwen2 file: it is hidden/heads there, 128 here)
    head_dim = getattr(model.config, "head_dim", model.config.hidden_size // model.config.num_attention_heads)
    assert head_dim == ref.config.head_dim == 128
    assert model.config.rope_parameters["rope_theta"] == ref.config.rope_parameters["rope_theta"]
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits, expected = model(ids).logits, ref(ids).logits
    assert expected.std() > 1.0  # peaked logits: a wrong weight would show
    torch.testing.assert_close(logits, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_and_tensor_names(model_dirs, f32_files, arch):
    reader = GGUFReader(f32_files[arch])
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "general.type") == "model"
    assert _field(reader, "general.file_type") == 0  # ALL_F32
    assert _field(reader, "general.quantization_version") == 2
    expected = {
        "block_count": 2,
        "context_length": 2048,
        "embedding_length": 512,
        "feed_forward_length": 768,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 128,
        "attention.value_length": 128,
        "rope.freq_base": 10000.0 if arch == "llama" else 1e6,
    }
    for key, value in expected.items():
        assert _field(reader, f"{arch}.{key}") == value, key
    eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    assert eps == pytest.approx(1e-5 if arch == "llama" else 1e-6, rel=1e-6)
    # LlamaModel adds these two; Qwen2Model/Qwen3Model do not
    assert (_field(reader, f"{arch}.vocab_size"), _field(reader, f"{arch}.rope.dimension_count")) == (
        (1536, 128) if arch == "llama" else (None, None)
    )

    names = [t.name for t in reader.tensors]
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    per_block += {
        "llama": [],
        "qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
        "qwen3": ["attn_q_norm", "attn_k_norm"],
    }[arch]
    want = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}" if n.endswith(".bias") else f"blk.{i}.{n}.weight" for i in range(2) for n in per_block
    }
    if arch == "llama":
        want.add("output.weight")  # tied embeddings (qwen2/qwen3) write no output
    assert len(names) == len(set(names)) and set(names) == want
    assert names[0] == "token_embd.weight"
    for tensor in reader.tensors:
        assert tensor.tensor_type == GGMLQuantizationType.F32
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml order: ne0 first
    assert shapes["blk.0.attn_k.weight"] == (512, 256)
    assert shapes["blk.1.ffn_down.weight"] == (768, 512)
    if arch == "qwen3":
        assert shapes["blk.1.attn_k_norm.weight"] == (128,)


@pytest.mark.parametrize("arch", ARCHS)
def test_qk_rows_permuted_for_llama_only(model_dirs, f32_files, arch):
    hf = load_file(str(model_dirs[arch] / "model.safetensors"))
    data = {t.name: np.asarray(t.data) for t in GGUFReader(f32_files[arch]).tensors}
    q, k = hf["model.layers.1.self_attn.q_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"]
    if arch == "llama":
        np.testing.assert_array_equal(data["blk.1.attn_q.weight"], permute(q, 4, 4))
        np.testing.assert_array_equal(data["blk.1.attn_k.weight"], permute(k, 4, 2))
        assert not np.array_equal(data["blk.1.attn_q.weight"], q)
        # the permutation pairs row r of a head's first half with row r of its second
        head = permute(q, 4, 4)[:128]
        np.testing.assert_array_equal(head[0::2], q[:64])
        np.testing.assert_array_equal(head[1::2], q[64:128])
    else:
        np.testing.assert_array_equal(data["blk.1.attn_q.weight"], q)
        np.testing.assert_array_equal(data["blk.1.attn_k.weight"], k)
    np.testing.assert_array_equal(data["blk.1.attn_v.weight"], hf["model.layers.1.self_attn.v_proj.weight"])


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizers(model_dirs, f32_files) -> dict:
    return {
        arch: (
            AutoTokenizer.from_pretrained(f32_files[arch].parent, gguf_file=f32_files[arch].name),
            AutoTokenizer.from_pretrained(model_dirs[arch]),
        )
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_metadata(f32_files, arch):
    reader = GGUFReader(f32_files[arch])
    llama = arch == "llama"
    assert _field(reader, "tokenizer.ggml.model") == ("llama" if llama else "gpt2")
    assert _field(reader, "tokenizer.ggml.pre") == ("default" if llama else "qwen2")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == (1536 if llama else 1531)
    assert tokens[:6] == ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    assert types[:6] == [3] * 6  # CONTROL
    if llama:
        assert tokens[6:262] == [f"<0x{b:02X}>" for b in range(256)] and set(types[6:262]) == {6}  # BYTE
        scores = _field(reader, "tokenizer.ggml.scores")
        assert len(scores) == 1536 and len(set(scores[262:])) == 1536 - 262  # a distinct rank per piece
        assert _field(reader, "tokenizer.ggml.merges") is None  # as llama.cpp: the scores order merges
    else:
        assert _field(reader, "tokenizer.ggml.scores") is None
        assert len(_field(reader, "tokenizer.ggml.merges")) > 1000
    ids = {key: _field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "unknown", "padding")}
    assert ids == {"bos": 1, "eos": 2, "unknown": 0, "padding": 3}
    assert _field(reader, "tokenizer.ggml.add_bos_token") is llama
    assert _field(reader, "tokenizer.ggml.add_eos_token") is False
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_encodes_like_the_hf_directory(tokenizers, arch):
    gguf_tok, hf_tok = tokenizers[arch]
    for text in TEXTS:
        ids = gguf_tok(text).input_ids
        assert ids == hf_tok(text).input_ids, text
        assert gguf_tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert (gguf_tok.bos_token_id, gguf_tok.eos_token_id, gguf_tok.unk_token_id, gguf_tok.pad_token_id) == (1, 2, 0, 3)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = gguf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert gguf_tok.chat_template == hf_tok.chat_template
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = gguf_tok(text, add_special_tokens=False).input_ids
    assert ids.count(4) == 3 and ids.count(5) == 2  # <|im_start|>/<|im_end|> stay whole
    if arch != "llama":
        assert ids == hf_tok(text, add_special_tokens=False).input_ids


def test_llama_tokenizer_known_differences(tokenizers):
    """transformers' GGUF llama tokenizer (Metaspace, prepend_scheme "first") adds no dummy
    prefix to text that already starts with a space, nor to text after a special token;
    the HF directory's tokenizer (Llama-2 legacy) and llama.cpp add one to both. No GGUF
    metadata says which: a reader that wants the llama.cpp behaviour must not follow
    transformers here."""
    gguf_tok, hf_tok = tokenizers["llama"]
    space = hf_tok.convert_tokens_to_ids("\u2581")
    for text in (" ", " hi", "  two  spaces"):
        expected = hf_tok(text).input_ids
        assert expected[:2] == [1, space]
        assert gguf_tok(text).input_ids == [1] + expected[2:]
    ids, expected = gguf_tok("<|im_start|>user").input_ids, hf_tok("<|im_start|>user").input_ids
    assert ids[:2] == expected[:2] == [1, 4]
    assert hf_tok.convert_ids_to_tokens(expected[2]).startswith("\u2581u")  # "▁us", "er"
    assert hf_tok.convert_ids_to_tokens(ids[2]) == "u"


# ----------------------------------------------------------------------------- quantized types


@pytest.mark.parametrize("tensor_type", [t for t in SUPPORTED_TYPES if t != "F32"])
def test_quantized_weights_within_expected_error(model_dirs, llama_tensors, tmp_path, tensor_type):
    path = write_gguf(model_dirs["llama"], tmp_path / f"model-{tensor_type}.gguf", tensor_type)
    reader = GGUFReader(path)
    assert _field(reader, "general.file_type") == int(gguf_writer.FILE_TYPES[tensor_type])
    worst = 0.0
    for tensor in reader.tensors:
        original = llama_tensors[tensor.name]
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type.name).reshape(original.shape)
        assert np.isfinite(values).all(), tensor.name
        if original.ndim == 1:
            assert tensor.tensor_type == GGMLQuantizationType.F32
            np.testing.assert_array_equal(values, original)
            continue
        assert tensor.tensor_type == GGMLQuantizationType[tensor_type], tensor.name
        rel = float(np.sqrt(((values - original) ** 2).mean() / (original**2).mean()))
        assert rel <= MAX_REL_RMS[tensor_type], (tensor.name, rel)
        worst = max(worst, rel)
    assert worst >= MIN_REL_RMS.get(tensor_type, 0.0)
    print(f"{tensor_type}: worst relative RMS error {worst:.4f}")


def test_quantized_file_loads_in_transformers(model_dirs, tmp_path):
    """A K-quant file through transformers' loader: its weights are the file's dequantized
    blocks, its logits near the F32 model's (the random tiny model amplifies the 1.9% weight
    error of Q6_K to about 8% in the logits; Q8_0 gives 2.6%, Q4_K 36%)."""
    path = write_gguf(model_dirs["qwen3"], tmp_path / "model-Q6_K.gguf", "Q6_K")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    blocks = {t.name: t for t in GGUFReader(path).tensors}
    up = blocks["blk.1.ffn_up.weight"]
    assert up.tensor_type == GGMLQuantizationType.Q6_K
    np.testing.assert_array_equal(
        model.model.layers[1].mlp.up_proj.weight.detach().numpy(),
        dequantize(np.asarray(up.data), "Q6_K").reshape(768, 512),
    )
    ref = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], dtype=torch.float32).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits, expected = model(ids).logits, ref(ids).logits
    err = ((logits - expected).norm() / expected.norm()).item()
    assert 1e-3 < err < 0.25, err


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_own_quantizers_on_edge_blocks(type_name):
    """Zero, constant, one-sign and single-spike blocks: finite scales, zeros stay zero."""
    rng = np.random.default_rng(0)
    rows = np.stack(
        [
            np.zeros(256),
            np.full(256, 0.5),
            np.full(256, -3.0),
            np.abs(rng.normal(size=256)),
            -np.abs(rng.normal(size=256)),
            np.eye(256)[7] * 100.0,
            rng.normal(size=256) * 1e-4,
            rng.normal(size=256) * 50,
        ]
    ).astype(np.float32)
    packed = quantize(rows, type_name)
    block_size, type_size = gguf_writer.gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    assert packed.dtype == np.uint8 and packed.shape == (8, 256 // block_size * type_size)
    values = dequantize(packed, type_name).reshape(rows.shape)
    assert np.isfinite(values).all()
    np.testing.assert_array_equal(values[0], 0)
    scale = np.abs(rows).max(axis=1, keepdims=True)
    assert (np.abs(values - rows) <= 0.6 * scale).all()  # no block decodes to something else
    assert abs(values[5, 7] - 100.0) < 1.0 and np.abs(np.delete(values[5], 7)).max() < 1.0


# ----------------------------------------------------------------------------- bad / split files


def test_split_files(model_dirs, llama_tensors, tmp_path):
    first = write_gguf(model_dirs["llama"], tmp_path / "model.gguf", split=3)
    paths = shard_paths(tmp_path / "model.gguf", 3)
    assert first == paths[0] and [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert not (tmp_path / "model.gguf").exists()
    seen, counts = {}, []
    for i, path in enumerate(paths):
        reader = GGUFReader(path)
        assert (_field(reader, "split.no"), _field(reader, "split.count")) == (i, 3)
        assert _field(reader, "split.tensors.count") == len(llama_tensors)
        assert (_field(reader, "general.architecture") is not None) == (i == 0)  # metadata: first file only
        assert (_field(reader, "tokenizer.ggml.model") is not None) == (i == 0)
        counts.append(len(reader.tensors))
        seen.update({t.name: np.asarray(t.data) for t in reader.tensors})
    assert list(seen) == list(llama_tensors)  # file order, nothing lost or repeated
    assert sum(counts) == len(llama_tensors) and max(counts) - min(counts) <= 1
    np.testing.assert_array_equal(seen["output.weight"], llama_tensors["output.weight"])


def test_no_tokenizer_and_other_architecture(model_dirs, tmp_path):
    path = write_gguf(model_dirs["qwen2"], tmp_path / "bare.gguf", tokenizer=False, architecture="tandem-unknown")
    reader = GGUFReader(path)
    assert not [key for key in reader.fields if key.startswith("tokenizer.")]
    assert _field(reader, "general.architecture") == "tandem-unknown"
    assert _field(reader, "tandem-unknown.block_count") == 2 and _field(reader, "qwen2.block_count") is None
    assert "blk.0.attn_q.bias" in {t.name for t in reader.tensors}
    with pytest.raises(ValueError, match="tandem-unknown"):
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)


def test_one_tensor_in_an_unsupported_type(model_dirs, llama_tensors, tmp_path):
    path = write_gguf(model_dirs["llama"], tmp_path / "odd.gguf", "Q8_0", unsupported={"blk.0.ffn_up.weight": "IQ4_NL"})
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["blk.0.ffn_up.weight"] == GGMLQuantizationType.IQ4_NL
    assert types["blk.1.ffn_up.weight"] == types["blk.0.ffn_down.weight"] == GGMLQuantizationType.Q8_0
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    original = llama_tensors["blk.0.ffn_up.weight"]
    values = dequantize(np.asarray(tensor.data), "IQ4_NL").reshape(original.shape)
    assert np.sqrt(((values - original) ** 2).mean() / (original**2).mean()) < 0.15


def test_rejects_bad_arguments(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="tensor_type"):
        write_gguf(model_dirs["llama"], tmp_path / "a.gguf", "Q8_1")
    with pytest.raises(ValueError, match="split"):
        write_gguf(model_dirs["llama"], tmp_path / "b.gguf", split=0)
    with pytest.raises(ValueError, match="2-D"):
        write_gguf(model_dirs["llama"], tmp_path / "c.gguf", unsupported={"output_norm.weight": "IQ4_NL"})
    with pytest.raises(ValueError, match="multiple"):
        quantize(np.zeros((2, 100), dtype=np.float32), "Q4_K")
