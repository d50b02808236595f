"""Drive a ModelRunner without a scheduler: prefill prompts (optionally in chunks), then
greedy decode steps, returning tokens and logits; shared by the attention-backend tests
on CPU and the CUDA checks. `hf_greedy` is the same for a transformers model (the
reference those tests compare with); `assert_greedy_matches_transformers` is that
comparison, and `random_model`/`save_random_model` make the tiny random models the
model-vs-transformers tests compare on."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.model_executor.model_loader import load_config
from tandem.model_executor.model_runner import ModelRunner, resolve_dtype
from tandem.server_args import ServerArgs


def make_runner(model_dir, **overrides) -> ModelRunner:
    kwargs = dict(
        model_path=str(model_dir),
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=64,
        random_seed=0,
        chunked_prefill_size=-1,
    )
    kwargs.update(overrides)
    args = ServerArgs(**kwargs)
    args.validate()
    if "kv_cache_dtype" not in overrides:
        # the activations' dtype, as the references these runners meet keep theirs (auto gives
        # quantized models a float16 cache: tests/unit/test_kv_cache_dtype.py bounds it)
        dtype = resolve_dtype(args.dtype, load_config(args.model_path), args.device)
        args.kv_cache_dtype = str(dtype).removeprefix("torch.")
    return ModelRunner(args)


def greedy_steps(
    runner: ModelRunner,
    prompts: list[list[int]],
    steps: int,
    chunk: int | None = None,
    lora_uids: list[int | None] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt (in chunks of `chunk` tokens when given), then `steps` greedy
    decode steps. Returns each request's generated ids and the logits of every step.
    `lora_uids`: each request's LoRA adapter (its load id in `runner.lora`; None: none)."""
    device = runner.device
    width = max(len(p) for p in prompts) + steps + 1
    slots = [list(range(1 + width * i, 1 + width * (i + 1))) for i in range(len(prompts))]
    for i, row in enumerate(slots):
        runner.req_to_token_pool.write(i, 0, torch.tensor(row, device=device))
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)
    last: list[torch.Tensor | None] = [None] * len(prompts)
    step = chunk or max(len(p) for p in prompts)
    while min(d - len(p) for d, p in zip(done, prompts)) < 0:
        ext = [min(step, len(p) - d) for d, p in zip(done, prompts)]
        ids = [t for p, d, e in zip(prompts, done, ext) for t in p[d : d + e]]
        live = [i for i, e in enumerate(ext) if e > 0]
        fb = ForwardBatch.for_rows(
            ForwardMode.EXTEND, ids, [done[i] for i in live], [ext[i] for i in live], [slots[i] for i in live], device
        )
        fb.req_pool_indices = torch.tensor(live, device=device)
        fb.lora_uids = None if lora_uids is None else [lora_uids[i] for i in live]
        logits = runner.forward(fb).next_token_logits
        for j, i in enumerate(live):
            done[i] += ext[i]
            if done[i] == len(prompts[i]):
                last[i] = logits[j]
    out_logits = [torch.stack(last)]
    generated = [[] for _ in prompts]
    for _ in range(steps):
        for s, g, nxt in zip(seqs, generated, out_logits[-1].argmax(-1).tolist()):
            s.append(nxt)
            g.append(nxt)
        fb = ForwardBatch.for_rows(
            ForwardMode.DECODE, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], [1] * len(seqs), slots, device
        )
        fb.lora_uids = lora_uids
        # A clone: under CUDA graphs the logits are a view that the next replay overwrites.
        out_logits.append(runner.forward(fb).next_token_logits.clone())
    return generated, out_logits


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generation of `steps` tokens after `prompt`: the new ids and each
    step's logits (float32)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=steps,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


def random_model(
    build: Callable[[], torch.nn.Module],
    *,
    seed: int = 0,
    spread: Callable[[torch.nn.Module], None] | None = None,
    logit_scale: float | None = 20.0,
) -> torch.nn.Module:
    """`build()` (a transformers model on a tiny config) under `torch.manual_seed(seed)`, in
    eval mode; `spread(model)` then widens weights random init leaves too flat, and the
    lm_head is scaled by `logit_scale` to spread the logits (random init leaves them
    near-uniform; None for a tied head)."""
    torch.manual_seed(seed)
    model = build().eval()
    with torch.no_grad():
        if spread is not None:
            spread(model)
        if logit_scale is not None:
            model.lm_head.weight.mul_(logit_scale)
    return model


def spread_gemma(model: torch.nn.Module) -> None:
    """A `spread` for Gemma: random init leaves its norm weights at 0 (scale 1), the attention
    scores too small to reach the soft-cap and the logits near-uniform (each of window,
    attention and final soft-cap then moves the last logits by about half their largest)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8)
        model.model.embed_tokens.weight.mul_(10)


def save_random_model(path, build: Callable[[], torch.nn.Module], **kwargs):
    """`random_model(build, **kwargs)` saved with save_pretrained to `path`; returns `path`."""
    random_model(build, **kwargs).save_pretrained(path)
    return path


def reference_model(model_dir, dtype: torch.dtype = torch.float32, **kwargs):
    """transformers' model on `model_dir` (kwargs to from_pretrained), in eval mode, with no
    EOS: it generates every step, as `greedy_steps` does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model


def assert_near_largest(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """`got` within `rel` of `ref`'s largest magnitude, element by element."""
    torch.testing.assert_close(got.float(), ref, atol=rel * ref.abs().max().item(), rtol=0)


def assert_greedy_matches_transformers(
    got: tuple[list[list[int]], list[torch.Tensor]],
    reference,
    prompts: list[list[int]],
    steps: int,
    *,
    rel: float = 1e-4,
    tokens: str = "all",
    logits: str = "all",
) -> None:
    """`got` (`greedy_steps`' ids and logits) against transformers' greedy `generate` of
    `steps` tokens after each prompt: `reference` is a transformers model or a model
    directory (loaded by `reference_model`, fp32). The generated tokens equal ("all", or
    only the first with tokens="first"), and every step's logits (or only the first
    step's, logits="first") within `rel` of the reference's largest."""
    ids, step_logits = got
    model = reference_model(reference) if isinstance(reference, (str, os.PathLike)) else reference
    for i, prompt in enumerate(prompts):
        ref_ids, ref_logits = hf_greedy(model, prompt, steps)
        if tokens == "first":
            assert ids[i][0] == ref_ids[0], f"prompt {i}"
        else:
            assert ids[i] == ref_ids, f"prompt {i}"
        for step, ref in enumerate(ref_logits[:1] if logits == "first" else ref_logits):
            assert_near_largest(step_logits[step][i], ref, rel)


def assert_radix_hit_matches_transformers(model_dir, reference, steps: int, **harness_kwargs) -> None:
    """Through the scheduler (fp32, CPU): a prompt, then one sharing its first 20 tokens
    (their KV from the radix cache), greedy `steps` tokens each; outputs as `reference`'s
    (a transformers model)."""
    from scheduler_harness import SchedulerHarness

    base = list(range(1, 30))
    prompts = [base, base[:20] + [40, 41, 42, 43, 44]]
    want = [hf_greedy(reference, p, steps)[0] for p in prompts]
    h = SchedulerHarness(
        model_dir, dtype="float32", device="cpu", random_seed=0, disable_overlap_schedule=True, **harness_kwargs
    )
    try:
        for i, p in enumerate(prompts):
            h.submit(str(i), input_ids=p, max_new_tokens=steps)
            h.run_until_idle()
        assert h.collected.cached_tokens["1"] >= 16  # the radix hit
        assert [h.collected.ids[str(i)] for i in range(len(prompts))] == want
    finally:
        h.close()
