"""What tensor parallelism costs on this machine (#11): the model runner's decode step
with --tp-size 1 and 2, and the time a TP rank spends inside the collectives.

    .venv/bin/python benchmarks/tp_decode.py --model-path DIR [--runs 1 2 1 2]
        [--batch-size 16] [--input-len 128] [--steps 40]

Each run is a fresh process (tp 1: this machine's cores as threads; tp 2: two gloo ranks,
the cores split between them, as the server does) that prefills `--batch-size` random
prompts and times `--steps` greedy decode forwards (sampling excluded). For tp 2 it also
times each call of the all-reduce / all-gather the layers make (including any wait for
the other rank), and then the all-reduce of one decode-sized tensor alone. It prints the
median step and the fastest one (the least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.distributed import TpGroup, init_tp_group
from tandem.forward_batch import ForwardBatch, ForwardMode


def _timed(fn, spent: list[float]):
    def wrapper(*args, **kwargs):
        tic = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[0] += time.perf_counter() - tic
        return out

    return wrapper


def measure(tp: TpGroup, args: argparse.Namespace) -> str:
    import tandem.layers.linear as linear
    import tandem.layers.vocab_embedding as vocab
    from tandem.model_executor.model_runner import ModelRunner
    from tandem.server_args import ServerArgs

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // tp.size))
    spent = [0.0]
    linear.tensor_model_parallel_all_reduce = _timed(linear.tensor_model_parallel_all_reduce, spent)
    vocab.tensor_model_parallel_all_reduce = _timed(vocab.tensor_model_parallel_all_reduce, spent)
    vocab.tensor_model_parallel_all_gather = _timed(vocab.tensor_model_parallel_all_gather, spent)
    bs, room = args.batch_size, args.input_len + args.steps + 1
    runner = ModelRunner(
        ServerArgs(
            model_path=args.model_path,
            device="cpu",
            max_total_tokens=bs * room,
            max_running_requests=bs,
            random_seed=1,
            chunked_prefill_size=-1,
        ),
        tp.rank,
        tp.size,
    )
    slots = [list(range(1 + room * i, 1 + room * (i + 1))) for i in range(bs)]
    for i, row in enumerate(slots):
        runner.req_to_token_pool.write(i, 0, torch.tensor(row))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, runner.vocab_size, (args.input_len,), generator=g).tolist() for _ in range(bs)]
    logits = runner.forward(
        ForwardBatch.for_rows(ForwardMode.EXTEND, [t for s in seqs for t in s], [0] * bs, [args.input_len] * bs, slots)
    ).next_token_logits
    steps, comm = [], []
    for _ in range(args.steps):
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
        fb = ForwardBatch.for_rows(
            ForwardMode.DECODE, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], [1] * bs, slots
        )
        spent[0] = 0.0
        tic = time.perf_counter()
        logits = runner.forward(fb).next_token_logits
        steps.append(time.perf_counter() - tic)
        comm.append(spent[0])
    fast = min(range(len(steps)), key=steps.__getitem__)
    line = (
        f"tp{tp.size}: decode step at batch {bs}: median {statistics.median(steps) * 1e3:.1f} ms, "
        f"fastest {steps[fast] * 1e3:.1f} ms"
    )
    if tp.size == 1:
        return line
    alone = []
    x = torch.randn(bs, runner.config.hidden_size)
    for _ in range(300):
        tic = time.perf_counter()
        dist.all_reduce(x)
        alone.append(time.perf_counter() - tic)
    return (
        f"{line}; in collectives: median {statistics.median(comm) * 1e3:.1f} ms "
        f"({statistics.median(comm) / statistics.median(steps):.0%}), fastest step's "
        f"{comm[fast] * 1e3:.1f} ms ({comm[fast] / steps[fast]:.0%}); one all_reduce of [{bs}, "
        f"{runner.config.hidden_size}] fp32 alone: min {min(alone) * 1e6:.0f} us, "
        f"median {statistics.median(alone) * 1e6:.0f} us"
    )


def _rank(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    tp = init_tp_group(rank, world, "cpu", rendezvous)
    try:
        line = measure(tp, args)
        if rank == 0:
            print(line, flush=True)
    finally:
        if world > 1:
            dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--runs", type=int, nargs="+", default=[1, 2, 1, 2], help="tp size of each run, in order")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    for tp_size in args.runs:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(tp_size, f"file://{tmp}/rendezvous", args), nprocs=tp_size)


if __name__ == "__main__":
    main()
