"""Tandem's GGUF loader against transformers' own GGUF loader on the same tiny files
(written here with the `gguf` package's writer from make_tiny_model's models, one per
tensor type): float32 greedy tokens equal, logits within 1e-4 of their largest; the
config, tokenizer and chat template built from the metadata; split sets and
`--tokenizer-path`."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_writer import write_gguf
from runner_steps import assert_greedy_matches_transformers, greedy_steps, make_runner
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.model_executor.model_loader import check_model, load_config
from tandem.server_args import ServerArgs
from tandem.tools.make_tiny_model import make_tiny_model
from tandem.utils.tokenizer import load_tokenizer

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 70))]
STEPS = 6
ALL_TYPES = [
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"),
]
# Every type on llama (whose Q/K rows llama.cpp permutes); a few on qwen2 (q/k/v biases)
# and qwen3 (q/k norms, tied head).
CASES = (
    [("llama", t) for t in ALL_TYPES]
    + [("qwen2", t) for t in ("F32", "Q4_K", "Q5_0")]
    + [("qwen3", t) for t in ("F32", "Q6_K", "Q4_1")]
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch, preset="gguf") for arch in ("llama", "qwen2", "qwen3")}


def hf_from_gguf(path):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy_steps does not stop at EOS either
    return model


def assert_matches_transformers(gguf_path, reference_path=None):
    got = greedy_steps(make_runner(gguf_path, dtype="float32"), PROMPTS, STEPS)
    assert_greedy_matches_transformers(got, hf_from_gguf(reference_path or gguf_path), PROMPTS, STEPS)


@pytest.mark.parametrize("arch,qtype", CASES)
def test_greedy_and_logits_equal_transformers_gguf_loader(model_dirs, tmp_path, arch, qtype):
    assert_matches_transformers(write_gguf(model_dirs[arch], tmp_path / f"{arch}-{qtype}.gguf", qtype))


def test_types_without_a_kernel_load_dequantized(model_dirs, tmp_path, caplog):
    """Types Tandem has no kernel for (gguf dequantizes them: here MXFP4 and the ternary
    TQ2_0) load dequantized, with one log line naming them, and equal transformers."""
    path = write_gguf(
        model_dirs["llama"],
        tmp_path / "mixed.gguf",
        "Q8_0",
        unsupported={"blk.0.ffn_up.weight": "MXFP4", "blk.1.attn_q.weight": "TQ2_0"},
    )
    with caplog.at_level("INFO", logger="tandem.model_executor.gguf_loader"):
        assert_matches_transformers(path)
    lines = [r.getMessage() for r in caplog.records if "no Tandem kernel" in r.getMessage()]
    assert lines and all("MXFP4, TQ2_0" in line for line in lines), lines


def scaled_model(tmp_path, scaling: dict):
    """make_tiny_model's llama (gguf preset) with `scaling` as its config's rope_scaling."""
    model_dir = make_tiny_model(tmp_path / scaling["rope_type"], arch="llama", preset="gguf")
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = scaling
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def assert_matches_directory(gguf_path, model_dir):
    """Tandem on the GGUF file against transformers on the Hugging Face directory it came
    from: greedy tokens equal, first-step logits within 1e-4 of their largest."""
    got = greedy_steps(make_runner(gguf_path, dtype="float32"), PROMPTS, STEPS)
    assert_greedy_matches_transformers(got, model_dir, PROMPTS, STEPS, logits="first")


def test_llama3_rope_frequency_factors_apply(tmp_path):
    """llama.cpp stores Llama 3 RoPE scaling as `rope_freqs.weight` (which transformers'
    GGUF loader ignores): Tandem on the GGUF equals transformers on the directory."""
    model_dir = scaled_model(
        tmp_path,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    path = write_gguf(model_dir, tmp_path / "llama3.gguf", "F32")
    assert len(load_config(str(path)).rope_freq_factors) == 64
    assert_matches_directory(path, model_dir)


def test_linear_rope_scaling_from_metadata(tmp_path):
    model_dir = scaled_model(tmp_path, {"rope_type": "linear", "factor": 4.0})
    path = write_gguf(model_dir, tmp_path / "linear.gguf", "F32")
    scaling = load_config(str(path)).rope_scaling
    assert (scaling["rope_type"], scaling["factor"]) == ("linear", 4.0)
    assert_matches_directory(path, model_dir)


def test_yarn_rope_scaling_is_refused_in_one_line(tmp_path):
    model_dir = scaled_model(tmp_path, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    path = write_gguf(model_dir, tmp_path / "yarn.gguf", "F32")
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported yet"):
        load_config(str(path))


def test_split_set_loads_like_one_file(model_dirs, tmp_path):
    first = write_gguf(model_dirs["llama"], tmp_path / "split.gguf", "Q4_K", split=3)
    one = write_gguf(model_dirs["llama"], tmp_path / "one" / "one.gguf", "Q4_K")
    assert_matches_transformers(first, reference_path=one)
    assert load_config(str(first)).gguf["files"] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_and_tokenizer_from_metadata(model_dirs, tmp_path, arch):
    path = write_gguf(model_dirs[arch], tmp_path / "m.gguf", "Q8_0")
    config, hf_config = load_config(str(path)), load_config(str(model_dirs[arch]))
    for key in (
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(config, key) == getattr(hf_config, key), key
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)  # GGUF holds a float32
    assert config.gguf == {"files": ["m.gguf"], "tensor_types": config.gguf["tensor_types"]}
    assert set(config.gguf["tensor_types"]) == {"Q8_0", "F32"}
    ours = load_tokenizer(str(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    messages = [{"role": "user", "content": 'Once upon a time, the baker said: "two on Sundays!"'}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    text = "Every morning he woke up at 4:30 and baked 12 loaves."
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.eos_token_id == theirs.eos_token_id == hf_config.eos_token_id


def test_tokenizer_path_stands_in_for_missing_metadata(model_dirs, tmp_path):
    path = write_gguf(model_dirs["qwen2"], tmp_path / "notok.gguf", "F16", tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer metadata"):
        check_model(ServerArgs(model_path=str(path)))
    check_model(ServerArgs(model_path=str(path), tokenizer_path=str(model_dirs["qwen2"])))
    check_model(ServerArgs(model_path=str(path), skip_tokenizer_init=True))
