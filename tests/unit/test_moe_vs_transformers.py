"""Mixture-of-experts families (tandem/models/mixtral.py, qwen2_moe.py, qwen3_moe.py)
against transformers on tiny random models made with transformers' own config and model
classes (several experts, top-k 2; Qwen2-MoE with its shared expert and one dense layer
through `mlp_only_layers`): fp32 greedy tokens equal and every step's logits within
1e-4 of their largest, prefilled whole, in chunks, and through the scheduler with a
radix hit; TP 2 equal to TP 1; bf16 near transformers' bf16; `--quantization` on the
experts. The fused expert layer (tandem/layers/moe.py) against a naive
per-token loop in fp32 and bf16; `--ep-size` other than 1 refused at start."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from runner_steps import (
    assert_greedy_matches_transformers,
    assert_radix_hit_matches_transformers,
    greedy_steps,
    make_runner,
    random_model,
)
from safetensors.torch import load_file

from tandem.layers.linear_kernel import make_linear_kernel
from tandem.layers.moe import FusedMoE, fused_experts, select_experts
from tandem.layers.quantization.gguf_linear import quantize_dense
from tandem.models.registry import resolve_model_class
from tandem.server_args import ServerArgs

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 6

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


def _mixtral(**over):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(intermediate_size=96, num_local_experts=4, sliding_window=None, **{**COMMON, **over})
    )


def _qwen2_moe(**over):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_experts=8,
        mlp_only_layers=[1],
        **{**COMMON, **over},
    )
    return Qwen2MoeForCausalLM(config)


def _qwen3_moe(**over):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=8,
        norm_topk_prob=True,
        head_dim=32,
        **{**COMMON, **over},
    )
    return Qwen3MoeForCausalLM(config)


FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}


def _routers(model):
    """Non-zero routers (Qwen MoE initializes them to zero)."""
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
            p.normal_(0, 0.5)


def _random(family, **over):
    """The family's tiny model, seeded, routers non-zero and logits spread."""
    return random_model(lambda: FAMILIES[family](**over), spread=_routers)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_moe(request, tmp_path_factory):
    model = _random(request.param)
    path = tmp_path_factory.mktemp("models") / f"tiny-{request.param}"
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the reference generates every step
    return request.param, path, model


def test_moe_greedy_and_logits_match_transformers(tiny_moe):
    family, path, _ = tiny_moe
    runner = make_runner(path, dtype="float32")
    assert type(runner.model).__module__ == f"tandem.models.{family}"
    got = greedy_steps(runner, PROMPTS, STEPS)
    assert_greedy_matches_transformers(got, path, PROMPTS, STEPS)


def test_moe_chunked_prefill_matches_transformers(tiny_moe):
    """Prompts prefilled in chunks of 4 tokens (each chunk routed on its own), greedy."""
    family, path, hf = tiny_moe
    got = greedy_steps(make_runner(path, dtype="float32"), PROMPTS, STEPS, chunk=4)
    assert_greedy_matches_transformers(got, hf, PROMPTS, STEPS)


def test_moe_radix_hit_matches_transformers(tiny_moe):
    """Through the scheduler: a prompt, then one sharing its first 20 tokens (their KV from
    the radix cache), greedy; outputs as transformers'."""
    family, path, hf = tiny_moe
    assert_radix_hit_matches_transformers(path, hf, STEPS, skip_tokenizer_init=True)


def test_moe_loads_transformers_stacked_expert_names(tiny_moe):
    """transformers 5's in-memory names (`mlp.experts.gate_up_proj`, 3-D) load as well as
    the per-expert names save_pretrained writes."""
    family, path, hf = tiny_moe
    cls = resolve_model_class(hf.config)
    from_file, from_memory = cls(hf.config), cls(hf.config)
    from_file.load_weights(load_file(str(path / "model.safetensors")).items())
    from_memory.load_weights(hf.state_dict().items())
    served = dict(from_file.named_parameters())
    for name, p in from_memory.named_parameters():
        torch.testing.assert_close(p, served[name], rtol=0, atol=0, msg=name)


def _naive(x, w13, w2, weights, ids):
    """Per token, per chosen expert: transformers' arithmetic, one token at a time."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = x[t] @ w13[e].t()
            y = (torch.nn.functional.silu(h[:inter]) * h[inter:]) @ w2[e].t()
            out[t] += (y * weights[t, j]).to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights_in_model_dtype", [False, True])
def test_fused_experts_equal_a_per_token_loop(dtype, weights_in_model_dtype):
    torch.manual_seed(1)
    tokens, hidden, inter, experts, k = 37, 64, 48, 8, 2
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / 8).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / 8).to(dtype)
    logits = torch.randn(tokens, experts).to(dtype)
    weights, ids = select_experts(logits, k, True, dtype if weights_in_model_dtype else None)
    assert weights.dtype == (dtype if weights_in_model_dtype else torch.float32)
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(tokens), atol=1e-2, rtol=0)
    got = fused_experts(x, w13, w2, weights, ids)
    want = _naive(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # an expert no token chose, a single token, no token
    ids1 = torch.tensor([[3, 5]])
    one = fused_experts(x[:1], w13, w2, weights[:1], ids1)
    torch.testing.assert_close(one.float(), _naive(x[:1], w13, w2, weights[:1], ids1).float(), atol=tol, rtol=tol)
    assert fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, hidden)


def test_select_experts_without_renormalizing():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, probs[:, [3, 2]])


def test_expert_intermediate_split_across_ranks_adds_up():
    """Each rank's slice of every expert's intermediate dimension (gate/up rows, down
    columns, read from the per-expert checkpoint tensors): partial outputs sum to the whole."""
    torch.manual_seed(2)
    experts, hidden, inter, tokens = 4, 32, 24, 9
    gate, up, down = (
        torch.randn(experts, inter, hidden),
        torch.randn(experts, inter, hidden),
        torch.randn(experts, hidden, inter),
    )
    x = torch.randn(tokens, hidden)
    weights, ids = select_experts(torch.randn(tokens, experts), 2, True)

    def layer(rank, size):
        m = FusedMoE(experts, hidden, inter, rank, size)
        for e in range(experts):
            m.weight_loader(m.gate_up_proj, gate[e], (e, "gate"))
            m.weight_loader(m.gate_up_proj, up[e], (e, "up"))
            m.weight_loader(m.down_proj, down[e], (e, "down"))
        return m

    whole = layer(0, 1).forward(x, weights, ids)
    parts = sum(layer(r, 2).forward(x, weights, ids) for r in range(2))
    torch.testing.assert_close(parts, whole, atol=1e-4, rtol=1e-4)
    stacked = FusedMoE(experts, hidden, inter, 1, 2)
    stacked.weight_loader(stacked.gate_up_proj, torch.cat([gate, up], 1), None)
    stacked.weight_loader(stacked.down_proj, down, None)
    torch.testing.assert_close(stacked.gate_up_proj, layer(1, 2).gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(stacked.down_proj, layer(1, 2).down_proj, rtol=0, atol=0)


def test_ep_size_other_than_one_is_refused():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/m", "--ep-size", "2"]))
    with pytest.raises(ValueError, match="--ep-size.*expert parallelism is not built"):
        args.validate()
    ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/m", "--ep-size", "1"])).validate()


def test_moe_under_quantization(tiny_moe, caplog):
    """`--quantization q8_0`: the expert projections whose input width is a multiple of 32
    are quantized too (Mixtral's all, Qwen's gate/up: their down_proj's 48 columns are
    not), the log says how many; the model still serves."""
    family, path, _ = tiny_moe
    with caplog.at_level("INFO"):
        runner = make_runner(path, dtype="float32", quantization="q8_0")
    [line] = [r.getMessage() for r in caplog.records if "expert projections quantized" in r.getMessage()]
    want = {"mixtral": "16 of 16", "qwen2_moe": "8 of 16", "qwen3_moe": "16 of 32"}[family]
    assert want in line
    ids, _ = greedy_steps(runner, PROMPTS, 2)
    assert all(len(g) == 2 for g in ids)


@pytest.mark.parametrize("method", ["q8_0", "q4_0"])
def test_quantized_experts_equal_the_dequantized_weights(method):
    """Each expert's projection rounded to the GGUF type: few tokens per expert run the
    C++ quantized kernel, many the dense kernel on the dequantized weights; both equal
    `torch.mm` on the dequantized stacked tensors, to the kernel's rounding."""
    torch.manual_seed(4)
    experts, hidden, inter = 4, 64, 96
    layer = FusedMoE(experts, hidden, inter)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.1)
        layer.down_proj.normal_(0, 0.1)
    deq = [
        torch.stack([torch.from_numpy(quantize_dense(p.data[e], method).dequantize()) for e in range(experts)])
        for p in (layer.gate_up_proj, layer.down_proj)
    ]
    layer.process_weights_after_loading("auto", method)
    assert layer.quantized == 2 * experts
    for tokens in (1, 3, 40):  # 40 tokens: more than QUANT_MAX_ROWS on every expert
        x = torch.randn(tokens, hidden)
        weights, ids = select_experts(torch.randn(tokens, experts), 2, True)
        with torch.inference_mode():
            got = layer.forward(x, weights, ids)
        want = fused_experts(x, deq[0], deq[1], weights, ids)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.slow  # two gloo ranks in subprocesses
def test_moe_on_two_ranks_equals_one(tmp_path):
    """TP 2: every expert's (and the shared expert's) intermediate dimension split across
    the ranks, one all-reduce per block; the logits of a prefill and decode steps equal
    TP 1's, and the ranks agree exactly."""
    from test_parallel_layers import _generate_on_rank, run_on_ranks

    from tandem.distributed import TpGroup

    dirs = []
    for family in sorted(FAMILIES):
        model = _random(family, vocab_size=1536)  # test_parallel_layers' prompts
        model.save_pretrained(tmp_path / family)
        dirs.append(str(tmp_path / family))
    single = _generate_on_rank(TpGroup(), dirs)
    ranks = run_on_ranks(_generate_on_rank, 2, tmp_path / "ranks", dirs)
    for d in dirs:
        for r in ranks:
            for got, want in zip(r[d]["logits"], single[d]["logits"]):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][d]["logits"], ranks[1][d]["logits"])), d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_expert_kernels_equal_the_stacked_matmuls(dtype):
    """`FusedMoE.process_weights_after_loading("auto")` (oneDNN-packed per expert on CPU):
    the same outputs as `torch.mm` on the stacked tensors, to rounding."""
    torch.manual_seed(3)
    experts, hidden, inter = 8, 64, 48
    plain, packed = (FusedMoE(experts, hidden, inter) for _ in range(2))
    with torch.no_grad():
        plain.gate_up_proj.normal_(0, 0.1)
        plain.down_proj.normal_(0, 0.1)
        for p, q in ((plain.gate_up_proj, packed.gate_up_proj), (plain.down_proj, packed.down_proj)):
            p.data, q.data = p.data.to(dtype), p.data.to(dtype).clone()
    packed.process_weights_after_loading("auto")
    # packed where oneDNN packs one such weight (it refuses bfloat16 on CPUs without AVX-512)
    assert (packed.kernels is not None) == (make_linear_kernel(plain.gate_up_proj.data[0], None, "auto") is not None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for tokens in (1, 2, 5, 40):
        x = torch.randn(tokens, hidden).to(dtype)
        weights, ids = select_experts(torch.randn(tokens, experts), 2, True)
        with torch.inference_mode():
            got, want = packed.forward(x, weights, ids), plain.forward(x, weights, ids)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_moe_bf16_matches_transformers_bf16(tiny_moe):
    """bf16 serving (routing weights in the family's dtype, the packed bf16 expert kernels):
    first-step logits within 3e-2 of transformers' bf16 largest, the same first token."""
    family, path, hf = tiny_moe
    got = greedy_steps(make_runner(path, dtype="bfloat16"), PROMPTS, 1)
    assert_greedy_matches_transformers(got, copy.deepcopy(hf).to(torch.bfloat16), PROMPTS, 1, rel=3e-2)
