"""Drive a ModelRunner without a scheduler: prefill prompts (optionally in chunks), then
greedy decode steps, returning tokens and logits; shared by the attention-backend tests
on CPU and the CUDA checks. `hf_greedy` is the same for a transformers model (the
reference those tests compare with)."""

from __future__ import annotations

import torch

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.model_executor.model_runner import ModelRunner
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
    return ModelRunner(args)


def greedy_steps(
    runner: ModelRunner, prompts: list[list[int]], steps: int, chunk: int | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt (in chunks of `chunk` tokens when given), then `steps` greedy
    decode steps. Returns each request's generated ids and the logits of every step."""
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
