"""A decode step on this tree's C++ CPU kernels against the same step on another commit's,
alternated in one process: `python benchmarks/kernel_ab.py --base COMMIT [--model-path FILE]
[--batch-size N] [--input-len N] [--steps N] [--prefill]`.

On a shared, noisy machine two runs one after another differ by more than most kernel
changes do; steps alternated every `--block` steps within one process see the same noise.
The base commit's kernel sources (tandem/kernels/csrc at COMMIT) are built as a second
library whose ops are registered as `torch.ops.tandem_base` (both libraries are loaded
RTLD_LOCAL, so neither's calls bind to the other's functions). One model (`OneBatchBench`,
greedy, EOS ignored) then runs its decode steps switching, every block, what calls the
kernels: the quantized linears (`QuantLinearKernel.ops`, the LM head's among them, with the
weight tiles that side's `quant_tiles` stores) and the decoder layers' one-call stack
(`decode_layers`). Other kernel calls (a model whose layers do not run fused) stay on this
tree's. With `--prefill` the steps measured are prefills of
the batch's prompts instead (each a fresh batch, released after). Prints per side the min,
p10, p25 and median step (ms) and the median ratio.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tandem.bench_one_batch import OneBatchBench, resolve_server_args
from tandem.bench_one_batch import parse_args as bench_args
from tandem.forward_batch import ForwardMode
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.quantization.gguf_linear import QuantLinearKernel
from tandem.utils.huge_pages import HugePageArena

REPO = Path(__file__).resolve().parents[1]
CSRC = "tandem/kernels/csrc"


def build_base(commit: str, work: Path) -> Path:
    """The base commit's kernels, built with their ops under `tandem_base`."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *argv], check=True, capture_output=True, text=True).stdout

    names = git("ls-tree", "--name-only", f"{commit}:{CSRC}").split()
    for name in names:
        text = git("show", f"{commit}:{CSRC}/{name}")
        text = re.sub(r"TORCH_LIBRARY(_FRAGMENT)?\(tandem_cpu,", r"TORCH_LIBRARY\1(tandem_base,", text)
        (work / name).write_text(text)
    sources = tuple(work / n for n in names if n.endswith(".cpp"))
    return cpu_kernels.build(sources=sources)


def quantiles(steps: list[float]) -> str:
    s = sorted(steps)
    at = {name: s[int(q * (len(s) - 1))] for name, q in (("min", 0), ("p10", 0.1), ("p25", 0.25), ("median", 0.5))}
    return " ".join(f"{k} {v * 1e3:.2f}" for k, v in at.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit whose kernels to measure against")
    parser.add_argument("--model-path", default=str(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=900, help="decode steps measured (half on each side)")
    parser.add_argument("--block", type=int, default=5, help="steps on one side before switching")
    parser.add_argument("--prefill", action="store_true", help="measure prefills of the prompts, not decode steps")
    args = parser.parse_args()

    ours = cpu_kernels.load()
    if ours is None:
        print("this tree's C++ kernels are not built", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        torch.ops.load_library(str(build_base(args.base, Path(work))))
    base = torch.ops.tandem_base

    out_len = args.steps + 21
    bench = OneBatchBench(
        resolve_server_args(
            bench_args(
                ["--model-path", args.model_path, "--batch-size", str(args.batch_size)]
                + ["--input-len", str(args.input_len), "--output-len", str(out_len)]
            )
        )
    )
    reqs = bench._make_reqs(args.batch_size, args.input_len, out_len)
    bench._step(reqs, ForwardMode.EXTEND)
    for _ in range(20):
        bench._step(reqs, ForwardMode.DECODE)
    if args.prefill:  # their rows back for the prefills' fresh batches
        for req in reqs:
            bench.kv.release(req)
    model = bench.runner.model
    kernels = [k for m in model.modules() if isinstance(k := getattr(m, "quant_kernel", None), QuantLinearKernel)]
    stack_owner = next(
        (m for m in model.modules() if getattr(m, "_stack_cache", None) is not None and m._stack_cache[1] is not None),
        None,
    )
    # Each side reads the weight tiles its own quant_tiles stores (their layout may differ).
    ours_tiles = [k.tiles for k in kernels]
    base_tiles = [
        None if t is None else base.quant_tiles(k.q, k.scale, k.mn, k.bits, k.group)
        for k, t in zip(kernels, ours_tiles)
    ]
    if any(t is not None for t in base_tiles):  # in huge pages, as the layer's own (place_in_huge_pages)
        arena = HugePageArena(HugePageArena.size_of([t for t in base_tiles if t is not None]))
        base_tiles = [None if t is None else arena.take(t) for t in base_tiles]
    swap = {id(t): b for t, b in zip(ours_tiles, base_tiles) if t is not None}
    ours_stack = base_stack = None
    if stack_owner is not None:
        fused, stack = stack_owner._stack_cache
        base_weights = [swap.get(id(w), w) for w in stack[1]]
        ours_stack, base_stack = (fused, stack), (fused, (base.decode_layers, base_weights, *stack[2:]))

    def prefill() -> float:
        fresh = bench._make_reqs(args.batch_size, args.input_len, 2)
        try:
            return bench._step(fresh, ForwardMode.EXTEND)
        finally:
            for req in fresh:
                bench.kv.release(req)

    sides = {"this tree": (ours, ours_stack, ours_tiles), f"base {args.base}": (base, base_stack, base_tiles)}
    steps: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(args.steps // args.block):
        name = list(sides)[block % 2]
        ops, cache, tiles = sides[name]
        for kernel, t in zip(kernels, tiles):
            kernel.ops, kernel.tiles = ops, t
        if cache is not None:
            stack_owner._stack_cache = cache
        steps[name] += [prefill() if args.prefill else bench._step(reqs, ForwardMode.DECODE) for _ in range(args.block)]
    print(
        f"{Path(args.model_path).name}, batch {args.batch_size}, prompts {args.input_len}, "
        f"{torch.get_num_threads()} threads, {len(kernels)} quantized linears, "
        f"decode stack {'swapped' if stack_owner is not None else 'not used'}{', prefills' if args.prefill else ''}"
    )
    for name, values in steps.items():
        print(f"  {name}: {quantiles(values)} ms")
    ours_med, base_med = (statistics.median(v) for v in steps.values())
    print(f"  this tree / base, median step: {ours_med / base_med:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
