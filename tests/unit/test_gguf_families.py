"""The model families beyond Llama/Qwen loaded from GGUF files written as llama.cpp's
converter writes them (tests/gguf_writer.py): Gemma 2, Gemma 3 text, Phi-3, Mixtral
(general.architecture "llama" with stacked expert tensors), Qwen2-MoE (shared expert)
and Qwen3-MoE, each a tiny random transformers model with its features on (window
shorter than the prompts, soft-caps, several experts with top-k 2), in F32 and Q8_0.

Tandem's fp32 greedy tokens equal transformers', every step's logits within 1e-4 of their
largest. The reference is transformers' own GGUF loader on the same file (its tensor
conversion: Gemma's norms minus 1, experts unstacked), given the source config (its GGUF
loader reads no soft-caps, window or `query_pre_attn_scalar` from the metadata); for
Mixtral, which that loader does not read, transformers on the source directory whose
weights were rounded to the file's type first (rows of blocks: the same values the file
holds). Tandem's config is the one it builds from the metadata alone."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import quantize, write_gguf
from runner_steps import assert_greedy_matches_transformers, greedy_steps, make_runner, random_model, spread_gemma
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.moe import FusedMoE
from tandem.model_executor.gguf_loader import iterate_gguf_weights
from tandem.model_executor.model_loader import iterate_weights, load_config
from tandem.models.base import rotary_dim_of
from tandem.models.registry import resolve_model_class

PROMPTS = [[2, 5, 9, 13, 7, 7, 3, 11, 4, 30], [2, 8], list(range(1, 17))]
STEPS = 5
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **COMMON,
        num_hidden_layers=3,
        intermediate_size=128,
        head_dim=32,
        query_pre_attn_scalar=32,  # llama.cpp scales by head_dim ** -0.5 (but on the 27B model)
        sliding_window=4,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    )
    return random_model(lambda: Gemma2ForCausalLM(config), spread=spread_gemma, logit_scale=None)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**COMMON, "num_key_value_heads": 1},
        num_hidden_layers=6,  # llama.cpp's 5:1 pattern: layer 5 global, the others sliding
        intermediate_size=128,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=4,
        final_logit_softcapping=8.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},  # as 4B-27B
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    return random_model(lambda: Gemma3ForCausalLM(config), seed=1, spread=spread_gemma, logit_scale=None)


def _phi3(**over):
    """Phi-3 with a window shorter than the prompts and half of each head rotated."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = dict(COMMON, original_max_position_embeddings=256, sliding_window=8, partial_rotary_factor=0.5)
    config = Phi3Config(
        **{**config, **over}, num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=False, pad_token_id=0
    )
    return random_model(lambda: Phi3ForCausalLM(config))


def _phi3_longrope():
    """The 128k models' RoPE: factors per rotary frequency, as tensors in the file."""
    half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    scaling = {
        "type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 2.0 * i for i in range(half)],
    }
    return _phi3(
        sliding_window=None,
        partial_rotary_factor=1.0,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_scaling=scaling,
    )


MOE = dict(COMMON, num_hidden_layers=2, num_experts_per_tok=2, tie_word_embeddings=False)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**MOE, intermediate_size=96, num_local_experts=4, sliding_window=None)
    return random_model(lambda: MixtralForCausalLM(config), seed=2)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **MOE,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        num_experts=8,
        mlp_only_layers=[],
    )
    return random_model(lambda: Qwen2MoeForCausalLM(config), seed=3)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **MOE, intermediate_size=128, moe_intermediate_size=64, num_experts=8, norm_topk_prob=True, head_dim=32
    )
    return random_model(lambda: Qwen3MoeForCausalLM(config), seed=4)


FAMILIES = {
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "phi3-longrope": _phi3_longrope,
    "mixtral": _mixtral,
    "qwen2moe": _qwen2_moe,
    "qwen3moe": _qwen3_moe,
}
CASES = [(family, "F32") for family in FAMILIES] + [(f, "Q8_0") for f in ("gemma2", "phi3", "mixtral", "qwen3moe")]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, build in FAMILIES.items():
        build().save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def rounded_dir(model_dir, out, qtype: str):
    """`model_dir` with every weight the writer stores in `qtype` (the 2-D ones but the
    MoE routers) rounded to it: quantized and dequantized row by row, as the file holds it."""
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            (out / name).write_text((model_dir / name).read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, data in tensors.items():
        if data.ndim == 2 and not name.endswith(("gate.weight", "norm.weight")):
            tensors[name] = gguf.quants.dequantize(quantize(data, qtype), gguf.GGMLQuantizationType[qtype])
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(out / "model.safetensors")
    )
    return out


def reference(family, model_dir, path, tmp_path, qtype):
    if family == "mixtral":  # transformers' GGUF loader reads no llama file's experts
        model_dir = model_dir if qtype == "F32" else rounded_dir(model_dir, tmp_path / "rounded", qtype)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, config=AutoConfig.from_pretrained(model_dir), dtype=torch.float32
        )
    model.eval().generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("family,qtype", CASES)
def test_greedy_and_logits_equal_transformers(model_dirs, tmp_path, family, qtype):
    path = write_gguf(model_dirs[family], tmp_path / f"{family}.gguf", qtype, tokenizer=False)
    runner = make_runner(path, dtype="float32", skip_tokenizer_init=True)
    assert (
        runner.model.config.architectures
        == json.loads((model_dirs[family] / "config.json").read_text())["architectures"]
    )
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    if qtype != "F32" and experts and cpu_kernels.load() is not None:  # the experts keep the file's blocks
        assert all(m.on_file_blocks == 2 * m.num_experts for m in experts)
    got = greedy_steps(runner, PROMPTS, STEPS)
    assert_greedy_matches_transformers(
        got, reference(family, model_dirs[family], path, tmp_path, qtype), PROMPTS, STEPS
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_from_metadata(model_dirs, tmp_path, family):
    """The config built from the metadata has the source's values for what the family uses."""
    path = write_gguf(model_dirs[family], tmp_path / "m.gguf", "F32", tokenizer=False)
    ours, source = load_config(str(path)), AutoConfig.from_pretrained(model_dirs[family])
    keys = [
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "layer_types",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "tie_word_embeddings",
        "original_max_position_embeddings",
    ]
    for key in keys:
        if hasattr(source, key):
            assert getattr(ours, key) == getattr(source, key), key
    assert rotary_dim_of(ours) == rotary_dim_of(source)
    for key in ("long_factor", "short_factor"):  # float32 in the file
        want = (source.rope_parameters or {}).get(key)
        assert (ours.rope_parameters or {}).get(key) == (None if want is None else pytest.approx(want, rel=1e-6)), key


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_rank_keeps_its_experts_blocks(model_dirs, tmp_path, tp_size):
    """From a Q8_0 file's expert stacks, each tensor-parallel rank loads its slice of every
    expert's intermediate dimension (gate and up rows, down columns) and, on the C++
    kernels, multiplies by that slice's blocks as by its dequantized weights."""
    path = write_gguf(model_dirs["qwen2moe"], tmp_path / "m.gguf", "Q8_0", tokenizer=False)
    whole = {name: w[...] for name, w in iterate_gguf_weights(str(path), show_progress=False)}
    gate, up, down = (whole[f"model.layers.0.mlp.experts.{p}_proj.weight"] for p in ("gate", "up", "down"))
    config = load_config(str(path))
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for rank in range(tp_size):
        model = resolve_model_class(config)(config, tp_rank=rank, tp_size=tp_size)
        model.load_weights(iterate_weights(str(path), show_progress=False))
        experts = model.model.layers[0].mlp.experts
        rows = slice(rank * experts.intermediate, (rank + 1) * experts.intermediate)
        assert torch.equal(experts.gate_up_proj.data, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(experts.down_proj.data, down[:, :, rows])
        w13, w2 = experts.gate_up_proj.data.clone(), experts.down_proj.data.clone()
        experts.process_weights_after_loading("auto")
        if cpu_kernels.load() is None:
            continue
        assert experts.on_file_blocks == 2 * experts.num_experts
        h = torch.randn(3, experts.intermediate, generator=torch.Generator().manual_seed(1))
        for e in range(experts.num_experts):
            torch.testing.assert_close(experts.kernels[0][e](x), x @ w13[e].T, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(experts.kernels[1][e](h), h @ w2[e].T, rtol=1e-5, atol=1e-5)


def test_per_expert_tensors_load_as_the_stacked(model_dirs, tmp_path):
    """llama.cpp's early Mixtral files hold one tensor per expert (`blk.N.ffn_gate.E`): they
    load the same weights as the stacked file, each expert's kernels on its own blocks."""
    x = torch.randn(3, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
    loaded = []
    for split in (False, True):
        path = write_gguf(
            model_dirs["mixtral"], tmp_path / f"{split}.gguf", "Q8_0", tokenizer=False, split_experts=split
        )
        config = load_config(str(path))
        model = resolve_model_class(config)(config)
        model.load_weights(iterate_weights(str(path), show_progress=False))
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        model.process_weights_after_loading("auto")
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        products = []
        if cpu_kernels.load() is not None:
            assert all(m.on_file_blocks == 2 * m.num_experts for m in experts)
            products = [kernel(x) for m in experts for kernel in m.kernels[0]]
        loaded.append((params, products))
    (stacked, stacked_products), (split, split_products) = loaded
    assert stacked.keys() == split.keys()
    assert all(torch.equal(stacked[name], split[name]) for name in stacked)
    assert all(torch.equal(a, b) for a, b in zip(stacked_products, split_products, strict=True))


@pytest.mark.parametrize("family,layers", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_attention_scale(tmp_path, family, layers):
    """llama.cpp scales the 27B models' scores by (hidden / heads) ** -0.5, not head_dim ** -0.5
    (the file says neither; the layer count tells the model): their query_pre_attn_scalar."""
    from transformers import Gemma2Config, Gemma3TextConfig

    kind = Gemma2Config if family == "gemma2" else Gemma3TextConfig
    source = kind(**COMMON, num_hidden_layers=layers, intermediate_size=64, head_dim=32, sliding_window=4)
    AutoModelForCausalLM.from_config(source).save_pretrained(tmp_path / "src")
    path = write_gguf(tmp_path / "src", tmp_path / "m.gguf", "F32", tokenizer=False)
    config = load_config(str(path))
    assert config.query_pre_attn_scalar == COMMON["hidden_size"] // COMMON["num_attention_heads"] != config.head_dim
    pattern = 2 if family == "gemma2" else 6  # llama.cpp's: the last layer of each run of `pattern` is global
    assert config.layer_types[:pattern] == ["sliding_attention"] * (pattern - 1) + ["full_attention"]
