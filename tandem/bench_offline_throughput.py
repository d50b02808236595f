"""Offline throughput of the `Engine`, no HTTP: `python -m tandem.bench_offline_throughput`.

The random dataset of `bench_serving` (same generator, same seed, so the same token ids)
goes through `Engine.generate(input_ids=[...], sampling_params=[...])` in ONE batch call:
greedy, `ignore_eos`, every output exactly as long as the dataset says. The scheduler
sees all requests at once and batches them as it likes (continuous batching, limited by
--max-running-requests and the KV capacity). Example::

    python -m tandem.bench_offline_throughput --model-path DIR --num-prompts 64 \\
        --random-input-len 128 --random-output-len 128 --random-range-ratio 0.5

Flags (besides every server flag of `python -m tandem.launch_server`: --model-path,
--max-running-requests, --max-total-tokens, --disable-radix-cache, ...):
  --num-prompts N          Requests (default 1000).
  --random-input-len N, --random-output-len N, --random-range-ratio R
                           As in bench_serving (defaults 1024 / 128 / 0.0).
  --seed N                 Seed of the prompts (default 1).
  --warmup-requests N      Requests run before the measured batch (default 1, 16 output tokens).
  --output-file PATH       Append one JSON line with the settings and the figures.
  --tag TEXT               Free-form label stored in the JSON line.

Reported: the duration of the batch call, request throughput, input / output / total
token throughput (tokens per second of that duration). Output tokens are counted from
each result's `meta_info.completion_tokens`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tandem.benchmarks.datasets import generate_random_requests, load_token_space
from tandem.benchmarks.metrics import throughput
from tandem.benchmarks.report import run_summary_rows
from tandem.server_args import ServerArgs

WARMUP_MAX_OUTPUT = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tandem.bench_offline_throughput",
        description="Offline throughput of the Engine on the random dataset (no HTTP).",
    )
    ServerArgs.add_cli_args(p)
    p.set_defaults(log_level="warning")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None)
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    if args.random_input_len < 1 or args.random_output_len < 1:
        p.error("--random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in [0, 1]")
    return args


def _sampling(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.entrypoints.engine import Engine

    server_args = ServerArgs.from_cli_args(args)
    server_args.validate()
    space = load_token_space(server_args.tokenizer_path)
    requests = generate_random_requests(
        args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, space, seed=args.seed
    )
    input_ids = [r.prompt_ids for r in requests]
    sampling = [_sampling(r.output_len) for r in requests]

    with Engine(server_args=server_args) as engine:
        if args.warmup_requests > 0:
            # A prompt of its own (another seed), so the radix cache gives the run nothing.
            warm = generate_random_requests(
                args.warmup_requests, args.random_input_len, WARMUP_MAX_OUTPUT, 1.0, space, seed=args.seed + 7919
            )
            engine.generate(
                input_ids=[w.prompt_ids for w in warm], sampling_params=[_sampling(w.output_len) for w in warm]
            )
        start = time.perf_counter()
        outputs = engine.generate(input_ids=input_ids, sampling_params=sampling)
        duration = time.perf_counter() - start

    completed = 0
    total_output = 0
    total_cached = 0
    for out in outputs:
        meta = out.get("meta_info") or {}
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            continue
        completed += 1
        total_output += int(meta.get("completion_tokens", len(out.get("output_ids") or [])))
        total_cached += int(meta.get("cached_tokens") or 0)
    total_input = sum(r.prompt_len for r in requests)
    return {
        "tag": args.tag,
        "model_path": server_args.model_path,
        "num_prompts": len(requests),
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "seed": args.seed,
        "max_running_requests": server_args.max_running_requests,
        "disable_radix_cache": server_args.disable_radix_cache,
        "duration": duration,
        "completed": completed,
        "failed": len(requests) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": total_cached,
        "request_throughput": throughput(completed, duration),
        "input_throughput": throughput(total_input, duration),
        "output_throughput": throughput(total_output, duration),
        "total_throughput": throughput(total_input + total_output, duration),
        "timestamp": time.time(),
    }


def format_report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            "{s:{c}^50}".format(s=" Offline Throughput Benchmark Result ", c="="),
            *run_summary_rows(r, with_cached_tokens=False),
            "=" * 50,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(format_report(record), flush=True)
    return 0 if record["completed"] == record["num_prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
