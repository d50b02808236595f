"""Multi-LoRA serving (#27): output throughput at 16 concurrent requests spread over 1, 4
and 8 adapters, against the base model alone (with and without --enable-lora).

    .venv/bin/python benchmarks/lora.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--rank 16] [--concurrency 16] [--max-new-tokens 64] [--repeats 3]

The adapters are random, in PEFT's format, on every projection (q/k/v/o/gate/up/down) at
`--rank`, written to a temporary directory from the model's shapes. One offline Engine per
configuration; each run is one batch of `--concurrency` prompts (distinct, 32 tokens each,
greedy, EOS ignored), request i using adapter i mod k. Throughput: output tokens over the
batch's wall time, the median of `--repeats` runs after a warm-up. Each row also prints the
machine's 1-minute load average when it ended (a shared machine: a load above the core
count means other processes took CPU time from the run). `--doc docs/benchmarks.md` writes
the run's section of that page (command, machine, commit, load, the table, a reading).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.benchmarks import report
from tandem.entrypoints.engine import Engine
from tandem.lora.pool import MODULE_LAYERS, whole_shapes
from tandem.model_executor.model_loader import load_config

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "benchmarks/lora.py"


def write_random_adapter(config, path: Path, rank: int, seed: int) -> str:
    """A PEFT adapter of random A and B on every projection of `config`'s layers."""
    gen = torch.Generator().manual_seed(seed)
    shapes = whole_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out, inp) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_LAYERS[module][0].split('.')[0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(shapes), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return str(path)


def throughput(engine: Engine, prompts: list[list[int]], names: list[str | None], max_new: int, repeats: int):
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    lora = names if any(n is not None for n in names) else None
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 4}, lora_path=lora)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=lora)
        elapsed = time.perf_counter() - start
        rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / elapsed)
    return statistics.median(rates)


def render_doc(rows: list[tuple[str, float, float]], args, command: str, started: float, load0: float) -> str:
    """The run's section of docs/benchmarks.md: the table against the base model and a reading."""
    n, base = args.concurrency, rows[0][1]
    body = [
        f"Model `{args.model}` (default flags: bfloat16 on this CPU), random rank-{args.rank} adapters on all "
        f"seven projections; {n} concurrent requests in one batch of the offline Engine, 32-token prompts, "
        f"{args.max_new_tokens} greedy output tokens (EOS ignored), request i on adapter i mod k; output tok/s "
        f"is the median of {args.repeats} runs after a warm-up, with the 1-minute load average as each row ended.",
        "",
        f"| {n} concurrent requests | output tok/s | vs base | load average |",
        "|---|---:|---:|---:|",
    ]
    body += [f"| {label} | {rate:.1f} | **{rate / base:.2f}x** | {load:.1f} |" for label, rate, load in rows]
    by = {label: rate for label, rate, _ in rows}

    def and_list(items: list[str]) -> str:
        return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)

    adapters = [(label, rate) for label, rate, _ in rows if label[0].isdigit()]
    reading = (
        f"With the {n} requests over "
        + and_list([label for label, _ in adapters])
        + " the throughput is "
        + and_list([f"{rate / base:.2f}x" for _, rate in adapters])
        + " of the base model's."
    )
    enabled = by.get("base, --enable-lora")
    if enabled:
        noise = abs(enabled / base - 1) > 0.05
        reading += (
            " `--enable-lora` with no request naming an adapter runs the base forward (no LoRA branch), "
            f"so its {enabled / base:.2f}x is this run's noise"
            + (", and differences of that size between the other rows are noise too." if noise else ".")
        )
    body += ["", reading]
    return report.render_section(
        SCRIPT,
        f"Multi-LoRA serving: {n} concurrent requests over 1, 4 and 8 adapters against the base model (#27)",
        command,
        started,
        (load0, os.getloadavg()[0]),
        body,
        report.git_rev(REPO, ignore=(Path(args.doc),)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--doc", default=None, help="write this run's section of this markdown page")
    args = parser.parse_args()
    started, load0 = time.time(), os.getloadavg()[0]
    command = report.command_line(SCRIPT, sys.argv[1:])
    config = load_config(args.model)
    n = args.concurrency
    prompts = [[1 + (i * 37 + j * 11) % 2000 for j in range(32)] for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(config, Path(tmp) / f"a{k}", args.rank, k) for k in range(8)]
        lora_paths = [f"a{k}={p}" for k, p in enumerate(paths)]
        runs = [("base", {}, 0), ("base, --enable-lora", {"lora_paths": lora_paths}, 0)]
        runs += [(f"{k} adapter{'s' if k > 1 else ''}", {"lora_paths": lora_paths}, k) for k in (1, 4, 8)]
        rows = []
        for label, flags, k in runs:
            names = [f"a{i % k}" if k else None for i in range(n)]
            with Engine(model_path=args.model, random_seed=0, max_loras_per_batch=8, **flags) as engine:
                rate = throughput(engine, prompts, names, args.max_new_tokens, args.repeats)
            rows.append((label, rate, os.getloadavg()[0]))
            print(f"{label:22s} {rate:8.1f} output tok/s (load {rows[-1][2]:.1f})", flush=True)
    base = rows[0][1]
    print(f"\n| {n} concurrent requests | output tok/s | vs base | load average |\n|---|---:|---:|---:|")
    for label, rate, load in rows:
        print(f"| {label} | {rate:.1f} | {rate / base:.2f}x | {load:.1f} |")
    if args.doc:
        section = render_doc(rows, args, command, started, load0)
        print(f"[lora] {args.doc}: {report.splice_section(Path(args.doc), SCRIPT, section)}", flush=True)


if __name__ == "__main__":
    main()
