"""The CUDA path on a GPU (run by `make gpu-check`; skipped without CUDA): greedy tokens
equal transformers' on the same GPU in float32 and bfloat16, the Triton backend equals
the torch-native one, and decode replayed from CUDA graphs equals eager decode."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from runner_steps import greedy_steps, make_runner  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 140)), [1, 300, 301, 302, 9, 9]]
STEPS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tandem.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "7m", arch="llama", preset="7m")


def hf_greedy(model_dir, dtype: torch.dtype, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).cuda().eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=STEPS,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[0][0].float()


@pytest.mark.parametrize("dtype,backend", [("float32", "triton"), ("float32", "torch_native"), ("bfloat16", "triton")])
def test_greedy_equals_transformers(model_dir, dtype, backend):
    runner = make_runner(model_dir, device="cuda", dtype=dtype, attention_backend=backend)
    ids, logits = greedy_steps(runner, PROMPTS, STEPS)
    for i, prompt in enumerate(PROMPTS):
        ref_ids, ref_first = hf_greedy(model_dir, getattr(torch, dtype), prompt)
        tol = 1e-3 if dtype == "float32" else 5e-2
        torch.testing.assert_close(logits[0][i], ref_first, atol=tol * ref_first.abs().max().item(), rtol=0)
        if dtype == "float32":
            assert ids[i] == ref_ids, f"prompt {i}"
        else:  # bf16 rounding may flip a near-tie later on: the first tokens must agree
            assert ids[i][:4] == ref_ids[:4], f"prompt {i}"


def test_triton_equals_torch_native(model_dir):
    a = greedy_steps(
        make_runner(model_dir, device="cuda", dtype="float32", attention_backend="torch_native"), PROMPTS, STEPS
    )
    b = greedy_steps(
        make_runner(model_dir, device="cuda", dtype="float32", attention_backend="triton", disable_cuda_graph=True),
        PROMPTS,
        STEPS,
        chunk=32,
    )
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graph_equals_eager(model_dir, dtype):
    graphs = make_runner(model_dir, device="cuda", dtype=dtype, cuda_graph_max_bs=16)
    eager = make_runner(model_dir, device="cuda", dtype=dtype, disable_cuda_graph=True)
    assert graphs.cuda_graph_runner is not None and eager.cuda_graph_runner is None
    assert graphs.cuda_graph_runner.batch_sizes == [1, 2, 4, 8, 16]
    for prompts in (PROMPTS[:1], PROMPTS[:3], (PROMPTS * 4)[:13]):  # buckets 1, 4 (padded), 16 (padded)
        assert greedy_steps(graphs, prompts, STEPS)[0] == greedy_steps(eager, prompts, STEPS)[0]
    # After a weight update the graphs are captured again and follow the new weights.
    ok, _ = graphs.update_weights_from_disk(str(model_dir), load_format="dummy")
    ok2, _ = eager.update_weights_from_disk(str(model_dir), load_format="dummy")
    assert ok and ok2
    assert greedy_steps(graphs, PROMPTS[:3], 4)[0] == greedy_steps(eager, PROMPTS[:3], 4)[0]


def test_bf16_is_the_cuda_default(model_dir):
    runner = make_runner(model_dir, device="cuda")
    assert runner.dtype == torch.bfloat16 and runner.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
    assert runner.server_args.attention_backend == "triton" and runner.cuda_graph_runner is not None
