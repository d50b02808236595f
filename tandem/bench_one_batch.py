"""Latency of one static batch through the model runner, no server:
`python -m tandem.bench_one_batch`.

For each batch size it prefills `batch_size` random prompts of `--input-len` tokens in
one EXTEND forward, then runs `--output-len - 1` DECODE forwards (greedy, EOS ignored),
timing each forward including sampling. This is the floor the serving engine's
overhead is measured against. Batches are built and run with the scheduler's own
code: `Req` / `ScheduleBatch`, the `ReqKVManager` that allocates and releases KV
(with a cache that reuses nothing), and `TpModelWorker.forward_batch_generation`. Example::

    python -m tandem.bench_one_batch --model-path DIR --batch-size 1 16 --input-len 128 --output-len 32

Flags (besides every server flag of `python -m tandem.launch_server`: --model-path,
--dtype, --device, --max-total-tokens, --random-seed, ...):
  --batch-size N [N ...]   Batch sizes to measure, in order (default 1).
  --input-len N [N ...]    Prompt lengths (default 1024); every combination is run.
  --output-len N [N ...]   Tokens generated per request, the prefill's included (default 16).
  --warmup / --no-warmup   Run each configuration once with 4 output tokens before
                           measuring it (default on).
  --run-name NAME          Label stored in the JSON lines (default "before").
  --output-file PATH       Append one JSON line per configuration (alias --result-filename).
  --seed N                 Seed of the random prompts (default 1).
  --floor / --no-floor     Also print each decode step's hardware floor and the step as a
                           multiple of it (default on; `tandem.benchmarks.hardware_floor`).

Without --max-total-tokens / --max-running-requests / --context-length the KV cache is
sized to fit the largest configuration exactly, not from free memory.

Reported per configuration (SGLang's bench_one_batch names): prefill latency (s) and
throughput (prompt tok/s), median decode step latency (s) and throughput (tok/s over the
batch), total latency and throughput (all prompt + output tokens / total time); with
--floor, the floor of the median decode step (weights + the batch's KV over the measured
memory bandwidth, or its FLOPs over the measured matmul throughput, whichever is larger)
and the step's latency as a multiple of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from tandem.benchmarks.datasets import generate_random_requests, load_token_space
from tandem.benchmarks.hardware_floor import decode_floor, measure_bandwidth, measure_matmul_flops
from tandem.forward_batch import ForwardMode
from tandem.mem_cache.chunk_cache import ChunkCache
from tandem.mem_cache.req_kv import ReqKVManager
from tandem.sampling.sampling_params import SamplingParams
from tandem.scheduler.schedule_batch import Req, ScheduleBatch
from tandem.scheduler.tp_worker import TpModelWorker
from tandem.server_args import ServerArgs

WARMUP_OUTPUT_LEN = 4


@dataclass
class OneBatchResult:
    run_name: str
    batch_size: int
    input_len: int
    output_len: int
    prefill_latency: float
    prefill_throughput: float
    median_decode_latency: float
    median_decode_throughput: float
    total_latency: float
    overall_throughput: float
    decode_floor: float | None = None  # seconds; with --floor
    floor_multiple: float | None = None


class OneBatchBench:
    def __init__(self, server_args: ServerArgs, seed: int = 1):
        self.worker = TpModelWorker(server_args)
        runner = self.worker.model_runner
        self.runner = runner
        self.kv = ReqKVManager(runner.req_to_token_pool, runner.token_to_kv_pool, ChunkCache(runner.token_to_kv_pool))
        self.space = load_token_space(server_args.tokenizer_path)
        self.seed = seed

    def floor(self, batch_size: int, input_len: int, output_len: int, bandwidth: float, matmul_flops: float) -> float:
        """Floor (s) of the median decode step: every request at input_len + output_len // 2."""
        runner = self.runner
        return decode_floor(
            runner.model,
            runner.dtype,
            [input_len + output_len // 2] * batch_size,
            runner.num_layers,
            runner.config.num_attention_heads,
            runner.num_kv_heads,
            runner.head_dim,
            bandwidth,
            matmul_flops,
            runner.kv_cache_dtype,
        ).floor_s

    def _sync(self) -> None:
        if str(self.runner.device).startswith("cuda"):
            torch.cuda.synchronize()

    def _make_reqs(self, batch_size: int, input_len: int, output_len: int) -> list[Req]:
        prompts = generate_random_requests(batch_size, input_len, output_len, 1.0, self.space, seed=self.seed)
        return [
            Req(
                rid=f"bench-{i}",
                origin_input_ids=p.prompt_ids,
                sampling_params=SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True),
            )
            for i, p in enumerate(prompts)
        ]

    def _step(self, reqs: list[Req], mode: ForwardMode) -> float:
        """Run one forward of `reqs`; append the sampled tokens; return its latency (s)."""
        self._sync()
        tic = time.perf_counter()
        if mode.is_extend():
            for req in reqs:
                self.kv.match_and_lock(req, 0)
            lens = [len(r.seq_ids) for r in reqs]
            batch = ScheduleBatch(
                reqs=reqs, forward_mode=mode, extend_lens=lens, out_cache_loc=self.kv.alloc_extend(reqs, lens)
            )
        else:
            batch = ScheduleBatch(reqs=reqs, forward_mode=mode, out_cache_loc=self.kv.alloc_decode(reqs))
        mwb = batch.launch(self.runner.vocab_size, self.runner.device)
        result = self.worker.forward_batch_generation(mwb).to_host(mwb)
        self._sync()
        latency = time.perf_counter() - tic
        for req, token_id in zip(reqs, result.next_token_ids):
            req.pending_tokens -= 1
            req.output_ids.append(token_id)
        return latency

    def run_once(self, batch_size: int, input_len: int, output_len: int, run_name: str = "") -> OneBatchResult:
        reqs = self._make_reqs(batch_size, input_len, output_len)
        try:
            prefill = self._step(reqs, ForwardMode.EXTEND)
            decodes = [self._step(reqs, ForwardMode.DECODE) for _ in range(output_len - 1)]
        finally:
            for req in reqs:
                self.kv.release(req)
        total = prefill + sum(decodes)
        median_decode = statistics.median(decodes) if decodes else 0.0
        return OneBatchResult(
            run_name=run_name,
            batch_size=batch_size,
            input_len=input_len,
            output_len=output_len,
            prefill_latency=prefill,
            prefill_throughput=batch_size * input_len / prefill,
            median_decode_latency=median_decode,
            median_decode_throughput=batch_size / median_decode if median_decode > 0 else 0.0,
            total_latency=total,
            overall_throughput=batch_size * (input_len + output_len) / total,
        )


def resolve_server_args(args: argparse.Namespace) -> ServerArgs:
    server_args = ServerArgs.from_cli_args(args)
    longest = max(args.input_len) + max(args.output_len)
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max(args.batch_size)
    if server_args.max_total_tokens is None:
        server_args.max_total_tokens = max(args.batch_size) * longest
    server_args.validate()
    if server_args.tp_size != 1:
        raise ValueError("--tp-size: bench_one_batch runs one rank (benchmarks/tp_decode.py measures TP)")
    return server_args


def format_table(rows: list[OneBatchResult]) -> str:
    header = (
        f"{'bs':>4} {'in':>6} {'out':>5} | {'prefill s':>10} {'prefill tok/s':>14} | "
        f"{'decode s':>10} {'decode tok/s':>13} | {'total s':>9} {'total tok/s':>12}"
    )
    with_floor = any(r.decode_floor is not None for r in rows)
    if with_floor:
        header += f" | {'floor s':>9} {'x floor':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r.batch_size:>4} {r.input_len:>6} {r.output_len:>5} | {r.prefill_latency:>10.4f} "
            f"{r.prefill_throughput:>14.1f} | {r.median_decode_latency:>10.5f} "
            f"{r.median_decode_throughput:>13.1f} | {r.total_latency:>9.3f} {r.overall_throughput:>12.1f}"
        )
        if with_floor and r.decode_floor is not None:
            line += f" | {r.decode_floor:>9.5f} {r.floor_multiple:>8.2f}"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tandem.bench_one_batch", description="Prefill and decode latency of the model runner alone."
    )
    ServerArgs.add_cli_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, nargs="+", default=[1024])
    p.add_argument("--output-len", type=int, nargs="+", default=[16])
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--run-name", default="before")
    p.add_argument("--output-file", "--result-filename", dest="output_file", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    for name in ("batch_size", "input_len", "output_len"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')}: values must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server_args = resolve_server_args(args)
    bench = OneBatchBench(server_args, seed=args.seed)
    context_len = bench.runner.context_len
    bandwidth = measure_bandwidth() if args.floor else 0.0
    if args.floor:
        print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows: list[OneBatchResult] = []
    for bs in args.batch_size:
        for input_len in args.input_len:
            for output_len in args.output_len:
                if input_len + output_len > context_len:
                    print(
                        f"skip bs={bs} in={input_len} out={output_len}: longer than the context ({context_len})",
                        file=sys.stderr,
                    )
                    continue
                if args.warmup:
                    bench.run_once(bs, input_len, min(output_len, WARMUP_OUTPUT_LEN))
                row = bench.run_once(bs, input_len, output_len, run_name=args.run_name)
                if args.floor and output_len > 1:
                    flops = measure_matmul_flops(bs, bench.runner.dtype)
                    row.decode_floor = bench.floor(bs, input_len, output_len, bandwidth, flops)
                    row.floor_multiple = row.median_decode_latency / row.decode_floor
                    print(
                        f"bs={bs}: matmul {flops / 1e9:.1f} GFLOP/s, decode floor {row.decode_floor:.5f} s "
                        f"({row.floor_multiple:.2f}x)",
                        flush=True,
                    )
                rows.append(row)
                print(
                    f"bs={bs} in={input_len} out={output_len}: prefill {row.prefill_latency:.4f} s, "
                    f"median decode {row.median_decode_latency:.5f} s, total {row.total_latency:.3f} s",
                    flush=True,
                )
                if args.output_file:
                    record = {
                        **row.__dict__,
                        "model_path": server_args.model_path,
                        "device": server_args.device,
                        "dtype": str(bench.runner.dtype),
                    }
                    with open(args.output_file, "a") as f:
                        f.write(json.dumps(record) + "\n")
    print(format_table(rows))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
