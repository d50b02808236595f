"""A mixture-of-experts decode step against a dense model of the same active parameters
(#25): the model runner's decode forward at batch 1 / 16 / 64, and transformers' on the
same MoE model.

    .venv/bin/python benchmarks/moe_decode.py [--batch-sizes 1 16 64] [--steps 20] [--dtype float32]

The MoE model is a Mixtral of `--experts` experts of intermediate size `--expert-inter`,
top-2; the dense one a Llama of intermediate size 2 x `--expert-inter` and otherwise the
same shapes, so a token multiplies the same number of MLP weights in both. Both run with
seeded random weights (`--load-format dummy`, config only). Each batch prefills
`--input-len`-token random prompts, then times `--steps` decode forwards (sampling
excluded); it prints the median step and the fastest. transformers: the same MoE config
with its own random init, one `forward` of one new token per request over a
`DynamicCache` filled by a prefill of the same length (the eager attention).
`--doc docs/benchmarks.md` writes the run's section of that page (command, machine, commit,
load average, the table with MoE / dense and Tandem / transformers ratios, a reading).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.benchmarks import report
from tandem.forward_batch import ForwardBatch, ForwardMode

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "benchmarks/moe_decode.py"
MOE, DENSE, HF = "Tandem moe (mixtral)", "Tandem dense (llama)", "transformers moe (mixtral)"


def _configs(args):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    moe = MixtralConfig(
        intermediate_size=args.expert_inter,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        sliding_window=None,
        **common,
    )
    dense = LlamaConfig(intermediate_size=2 * args.expert_inter, **common)
    moe.architectures, dense.architectures = ["MixtralForCausalLM"], ["LlamaForCausalLM"]
    return {"moe (mixtral)": moe, "dense (llama)": dense}


def _runner(config, root: str, name: str, dtype: str, batch: int, input_len: int, steps: int):
    from tandem.model_executor.model_runner import ModelRunner
    from tandem.server_args import ServerArgs

    path = os.path.join(root, name.split()[0])
    config.save_pretrained(path)
    args = ServerArgs(
        model_path=path,
        device="cpu",
        dtype=dtype,
        load_format="dummy",
        max_total_tokens=batch * (input_len + steps + 2) + 8,
        max_running_requests=max(batch, 1),
        random_seed=0,
        chunked_prefill_size=-1,
    )
    args.validate()
    return ModelRunner(args)


def time_tandem(runner, batch: int, input_len: int, steps: int, vocab: int) -> list[float]:
    width = input_len + steps + 1
    slots = [list(range(1 + width * i, 1 + width * (i + 1))) for i in range(batch)]
    for i, row in enumerate(slots):
        runner.req_to_token_pool.write(i, 0, torch.tensor(row))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (batch, input_len), generator=gen).tolist()
    fb = ForwardBatch.for_rows(
        ForwardMode.EXTEND, [t for p in prompts for t in p], [0] * batch, [input_len] * batch, slots, "cpu"
    )
    fb.req_pool_indices = torch.arange(batch)
    last = runner.forward(fb).next_token_logits.argmax(-1).tolist()
    lens = [input_len] * batch
    times = []
    for _ in range(steps):
        fb = ForwardBatch.for_rows(ForwardMode.DECODE, last, lens, [1] * batch, slots, "cpu")
        tic = time.perf_counter()
        logits = runner.forward(fb).next_token_logits
        times.append(time.perf_counter() - tic)
        last = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    return times


@torch.inference_mode()
def time_transformers(config, dtype: torch.dtype, batch: int, input_len: int, steps: int) -> list[float]:
    from transformers import DynamicCache, MixtralForCausalLM

    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = MixtralForCausalLM(config).to(dtype).eval()
    ids = torch.randint(1, config.vocab_size, (batch, input_len))
    cache = DynamicCache(config=config)
    out = model(ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - tic)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return times


def _ratio(a: float | None, b: float | None) -> str:
    return f"**{a / b:.2f}x**" if a and b else "-"


def render_doc(results: dict[tuple[str, int], list[float]], args, command: str, started: float, load0: float) -> str:
    """The run's section of docs/benchmarks.md: a table per batch size with the ratios, a reading."""
    med = {k: statistics.median(v) * 1e3 for k, v in results.items()}
    fast = {k: min(v) * 1e3 for k, v in results.items()}

    def cell(name: str, batch: int) -> str:
        return f"{med[name, batch]:.2f} ({fast[name, batch]:.2f})" if (name, batch) in med else "-"

    body = [
        f"{args.dtype}, {args.threads} thread(s), seeded random weights. MoE: a Mixtral of hidden {args.hidden}, "
        f"{args.layers} layers, {args.heads} heads ({args.heads // 2} KV), {args.experts} experts of intermediate "
        f"{args.expert_inter}, top-2. Dense: a Llama of the same shapes with intermediate {2 * args.expert_inter}, "
        "so a token multiplies as many MLP weights (the same active parameters). Each batch prefills "
        f"{args.input_len}-token prompts, then times {args.steps} decode forwards (the model runner's, sampling "
        "excluded); transformers: the same Mixtral config, eager attention, one `forward` of one token per "
        "request over a `DynamicCache`. Median step in ms, the fastest in parentheses.",
        "",
        "| batch | Tandem MoE | Tandem dense | MoE / dense | transformers MoE | Tandem / transformers (MoE) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    moe_dense, vs_hf = [], []
    for b in args.batch_sizes:
        m, d, h = med.get((MOE, b)), med.get((DENSE, b)), med.get((HF, b))
        body.append(f"| {b} | {cell(MOE, b)} | {cell(DENSE, b)} | {_ratio(m, d)} | {cell(HF, b)} | {_ratio(m, h)} |")
        where = f"batch {b}" if not moe_dense else str(b)
        if m and d:
            moe_dense.append(f"{m / d:.2f}x ({where})")
        if m and h:
            vs_hf.append(f"{m / h:.2f}x ({where})")
    reading = (
        f"Against the dense model of the same active parameters the MoE step takes {', '.join(moe_dense)} of "
        "its time (medians)"
    )
    reading += (
        f"; against transformers on the same MoE model, {', '.join(vs_hf)} of transformers' (below 1: Tandem faster)."
        if vs_hf
        else "."
    )
    spread = max((med[k] / fast[k] for k in med), default=1.0)
    if spread > 1.5:
        reading += (
            f" Medians run up to {spread:.1f}x the fastest steps (threads descheduled mid-step on a shared "
            "machine): ratios closer to 1 than that spread say little."
        )
    body += ["", reading]
    return report.render_section(
        SCRIPT,
        "MoE decode step: against a dense model of the same active parameters, and against transformers (#25)",
        command,
        started,
        (load0, os.getloadavg()[0]),
        body,
        report.git_rev(REPO, ignore=(Path(args.doc),)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-inter", type=int, default=1024)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--doc", default=None, help="write this run's section of this markdown page")
    args = p.parse_args()
    started, load0 = time.time(), os.getloadavg()[0]
    command = report.command_line(SCRIPT, sys.argv[1:])
    results: dict[tuple[str, int], list[float]] = {}
    torch.set_num_threads(args.threads)
    print(
        f"# {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"{args.threads} threads, "
        f"torch {torch.__version__}, {args.dtype}; hidden {args.hidden}, {args.layers} layers, "
        f"{args.experts} experts of {args.expert_inter} (top-2) vs dense {2 * args.expert_inter}"
    )
    print("| model | batch | median step (ms) | fastest (ms) | per token (ms) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for batch in args.batch_sizes:
            configs = _configs(args)
            rows = []
            for name, config in configs.items():
                runner = _runner(config, root, name, args.dtype, batch, args.input_len, args.steps)
                rows.append((f"Tandem {name}", time_tandem(runner, batch, args.input_len, args.steps, args.vocab)))
                del runner
            if not args.no_transformers:
                dtype = getattr(torch, args.dtype)
                times = time_transformers(configs["moe (mixtral)"], dtype, batch, args.input_len, args.steps)
                rows.append((HF, times))
            for name, times in rows:
                results[name, batch] = times
                med = statistics.median(times) * 1e3
                print(f"| {name} | {batch} | {med:.2f} | {min(times) * 1e3:.2f} | {med / batch:.3f} |", flush=True)
    if args.doc:
        section = render_doc(results, args, command, started, load0)
        print(f"[moe_decode] {args.doc}: {report.splice_section(Path(args.doc), SCRIPT, section)}", flush=True)


if __name__ == "__main__":
    main()
