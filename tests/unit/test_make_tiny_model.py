"""Tests for tandem.tools.make_tiny_model: files, weights, tokenizers, HF loading."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tandem.tools.make_tiny_model import (
    BYTE_TOKENS,
    PRESETS,
    SPACE,
    make_config,
    make_tiny_model,
    make_weights,
)

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
SPECIAL_IDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<|im_start|>": 4, "<|im_end|>": 5}
PROMPTS = ["Once upon a time", "The weather is", "1 2 3", "Hello, world!"]

HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _no_special_token_text(text: str) -> bool:
    """Special-token strings ("<s>", ...) in input text are matched as special tokens, by design."""
    return not any(token in text for token in SPECIAL_IDS)


ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60).filter(_no_special_token_text)
# A literal "▁" is SentencePiece's space marker, so it decodes as " " (as in Llama-2).
LLAMA_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=SPACE), max_size=60
).filter(_no_special_token_text)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch=arch, preset="tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_tokenizers(model_dirs):
    return {arch: AutoTokenizer.from_pretrained(path) for arch, path in model_dirs.items()}


@pytest.fixture(scope="module")
def raw_tokenizers(model_dirs):
    return {arch: Tokenizer.from_file(str(path / "tokenizer.json")) for arch, path in model_dirs.items()}


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return {
        arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for arch, path in model_dirs.items()
    }


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("arch", ARCHS)
def test_directory_contents(model_dirs, arch):
    names = {p.name for p in model_dirs[arch].iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    }
    assert (model_dirs[arch] / "model.safetensors").stat().st_size < 4 * 2**20


@pytest.mark.parametrize("arch", ARCHS)
def test_config_old_form(model_dirs, arch):
    cfg = _read_json(model_dirs[arch] / "config.json")
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert cfg["architectures"] == [expected_arch]
    assert cfg["model_type"] == arch
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["head_dim"] * cfg["num_attention_heads"] == cfg["hidden_size"]
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["torch_dtype"] == "float32"
    assert cfg["hidden_act"] == "silu"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "rope_parameters" not in cfg
    if arch == "llama":
        assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == (1e-5, 10000.0, False)
        assert cfg["attention_bias"] is False
    else:
        assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == (1e-6, 1000000.0, True)
    gen = _read_json(model_dirs[arch] / "generation_config.json")
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_names_and_dtypes(model_dirs, arch):
    cfg = _read_json(model_dirs[arch] / "config.json")
    tensors = load_file(str(model_dirs[arch] / "model.safetensors"))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        if arch == "qwen2":
            expected |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        if arch == "qwen3":
            expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    if arch == "llama":
        expected.add("lm_head.weight")
    assert set(tensors) == expected
    assert all(t.dtype == torch.float32 for t in tensors.values())
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    assert tensors["model.embed_tokens.weight"].shape == (cfg["vocab_size"], h)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (kv, h)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (h, cfg["intermediate_size"])
    norm = tensors["model.norm.weight"]
    assert (norm - 1).abs().max() < 0.6 and norm.std() > 0.01
    if arch == "qwen3":
        assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (cfg["head_dim"],)


def test_weights_are_seeded():
    shape = PRESETS["tiny"]
    a = make_weights(shape, 300, "qwen2", seed=0)
    b = make_weights(shape, 300, "qwen2", seed=0)
    c = make_weights(shape, 300, "qwen2", seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_whole_directory_is_deterministic(model_dirs, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch="llama")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / name).read_bytes() == (model_dirs["llama"] / name).read_bytes(), name


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 0.1e6, 1e6), ("gguf", 3e6, 7e6), ("7m", 5e6, 9e6), ("100m", 80e6, 120e6), ("wide", 25e6, 45e6)],
)
@pytest.mark.parametrize("arch", ARCHS)
def test_preset_sizes(preset, low, high, arch):
    config_dict = make_config(PRESETS[preset], 1536, arch, bos_id=1, eos_id=2)
    config = transformers.AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert low < n_params < high


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_preset_fits_every_block_type(arch):
    """Every dimension of every 2-D weight is a multiple of 256 (a K-quant super-block)."""
    tensors = make_weights(PRESETS["gguf"], 1536, arch, seed=0)
    matrices = [t for t in tensors.values() if t.dim() == 2]
    assert len(matrices) >= 7 * PRESETS["gguf"].num_hidden_layers + 1
    assert all(d % 256 == 0 for t in matrices for d in t.shape)
    assert PRESETS["gguf"].head_dim == 128


def test_cli(tmp_path):
    out = tmp_path / "cli_model"
    result = subprocess.run(
        [sys.executable, "-m", "tandem.tools.make_tiny_model", "--arch", "qwen2", "--out", str(out), "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert _read_json(out / "config.json")["architectures"] == ["Qwen2ForCausalLM"]


def test_rejects_unknown_arch_and_preset(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "y", preset="huge")


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("arch", ARCHS)
def test_special_token_ids(model_dirs, hf_tokenizers, arch):
    tok = hf_tokenizers[arch]
    for token, token_id in SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(token) == token_id
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 3, 0)
    tok_cfg = _read_json(model_dirs[arch] / "tokenizer_config.json")
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not isinstance(tok_cfg.get("extra_special_tokens", {}), list)


def test_llama_adds_bos_qwen_does_not(hf_tokenizers):
    assert hf_tokenizers["llama"]("hi").input_ids[0] == 1
    assert hf_tokenizers["llama"]("").input_ids == [1]
    for arch in ("qwen2", "qwen3"):
        assert 1 not in hf_tokenizers[arch]("hi").input_ids
        assert hf_tokenizers[arch]("").input_ids == []


def test_qwen3_shares_qwen2_tokenizer(model_dirs):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (model_dirs["qwen3"] / name).read_bytes() == (model_dirs["qwen2"] / name).read_bytes(), name


def test_llama_vocab_has_byte_tokens(raw_tokenizers):
    vocab = raw_tokenizers["llama"].get_vocab()
    assert [vocab[b] for b in BYTE_TOKENS] == list(range(6, 262))


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_size_matches_config(model_dirs, hf_tokenizers, raw_tokenizers, arch):
    cfg = _read_json(model_dirs[arch] / "config.json")
    assert cfg["vocab_size"] == len(hf_tokenizers[arch]) == raw_tokenizers[arch].get_vocab_size()
    assert 1000 <= cfg["vocab_size"] <= 2000


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(hf_tokenizers, arch):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = hf_tokenizers[arch].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = hf_tokenizers[arch].apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("Hi there<|im_end|>\n")
    ids = hf_tokenizers[arch](text, add_special_tokens=False).input_ids
    assert ids.count(4) == 3 and ids.count(5) == 2


FIXED_STRINGS = [
    "",
    " ",
    "hi",
    " hi",
    "  two  spaces  ",
    "a\nb\tc\r\n",
    "日本語 😀",
    "café naïve",
    "e\u0301",
    "x" * 50,
    "\x00\x7f",
]


@pytest.mark.parametrize("text", FIXED_STRINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_fixed(hf_tokenizers, arch, text):
    tok = hf_tokenizers[arch]
    ids = tok(text).input_ids
    expected = unicodedata.normalize("NFC", text) if arch != "llama" else text  # Qwen2/3 normalize to NFC
    assert tok.decode(ids, skip_special_tokens=True) == expected
    assert 0 not in ids  # never <unk>


@HYPOTHESIS
@given(text=LLAMA_TEXT)
def test_llama_round_trip_any_unicode(hf_tokenizers, raw_tokenizers, text):
    ids = hf_tokenizers["llama"](text).input_ids
    assert ids == raw_tokenizers["llama"].encode(text).ids
    assert 0 not in ids
    assert hf_tokenizers["llama"].decode(ids, skip_special_tokens=True) == text
    assert raw_tokenizers["llama"].decode(ids) == text


@HYPOTHESIS
@given(text=ANY_TEXT)
def test_qwen2_round_trip_any_unicode(hf_tokenizers, raw_tokenizers, text):
    ids = hf_tokenizers["qwen2"](text).input_ids
    assert ids == raw_tokenizers["qwen2"].encode(text).ids
    expected = unicodedata.normalize("NFC", text)
    assert hf_tokenizers["qwen2"].decode(ids, skip_special_tokens=True) == expected
    assert raw_tokenizers["qwen2"].decode(ids) == expected


def test_common_words_are_single_tokens(raw_tokenizers):
    assert raw_tokenizers["llama"].encode("the", add_special_tokens=False).tokens == [SPACE + "the"]
    assert len(raw_tokenizers["qwen2"].encode(" the").ids) == 1


# ----------------------------------------------------------------------------- HF model


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_without_missing_or_unexpected_weights(model_dirs, arch):
    model, info = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (arch != "llama")
    raw = load_file(str(model_dirs[arch] / "model.safetensors"))
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, raw["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_peaked_and_varied(hf_models, hf_tokenizers, arch):
    model, tok = hf_models[arch], hf_tokenizers[arch]
    gaps, distinct = [], []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=24,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
        scores = torch.stack(out.scores)[:, 0]
        top2 = scores.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        distinct.append(len(set(out.sequences[0, ids.shape[1] :].tolist())))
        assert scores.std(dim=-1).mean() > 2.0  # logits spread over several units
    gaps = torch.cat(gaps)
    assert (gaps > 1e-3).float().mean() > 0.95
    assert min(distinct) >= 3 and sum(distinct) / len(distinct) >= 8
