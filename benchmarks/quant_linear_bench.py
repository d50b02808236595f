"""Throughput of the quantized CPU matmul (`tandem_cpu.quant_linear`) on weights that come
from memory: `python benchmarks/quant_linear_bench.py [--threads N] [--rows R] [--march MARCH]`.

Multiplies `--rows` bfloat16 rows (`--dtype float32`: float32 rows, rounded to int8 as a
CPU without native bfloat16 serves them, `int8_x`) by each of 60 distinct 3072 x 576 weights
in the 4-bit layout (float16 scales, the default model's Q4_1 gate-up shape; `--bits 8`: the
8-bit layout of Q8_0, group 32), so that the weights do not stay in cache, and prints the time
per matmul (the fastest of 5 passes) and the weight bytes read per second; beside it oneDNN's
packed matmul in the same dtype on dense copies of the same shape (none where oneDNN packs no
such weight: bfloat16 without AVX-512). `--rows` takes several counts. `--tiles` passes each
weight's stored tiles (`quant_tiles`), as the layers do where the build has them. `--march` builds
and measures the kernel for another CPU (e.g. `x86-64-v3`: AVX2 without AVX-512, the
avx2_maddubs path) instead of this machine's build.
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear_kernel import PackedCpuLinear, can_pack

OUT, IN, COUNT = 3072, 576, 60


def per_call(fn, calls: int, repeats: int = 5) -> float:
    """Seconds per call: the fastest of `repeats` passes (a pass makes `calls` calls), so that
    other work on a shared machine inflates it less."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--march", default=None, help="build the kernel with -march=MARCH (default: native)")
    parser.add_argument(
        "--tiles", action="store_true", help="pass each weight's stored tiles (quant_tiles), as layers do"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.march:
        torch.ops.load_library(str(cpu_kernels.build((cpu_kernels.CSRC / "quant_linear_cpu.cpp",), args.march)))
        ops = torch.ops.tandem_cpu
    else:
        ops = cpu_kernels.load()
    if ops is None:
        raise SystemExit("Tandem's C++ CPU kernels are not built")
    weights = [
        (
            torch.randint(0, 256, (OUT, IN * args.bits // 8), dtype=torch.uint8),
            torch.rand(OUT, IN // 32).half(),
            torch.rand(OUT, IN // 32).half(),
        )
        for _ in range(COUNT)
    ]
    tiles = [ops.quant_tiles(*w, args.bits, 32) if args.tiles else None for w in weights]
    dtype = getattr(torch, args.dtype)
    packs = can_pack(torch.empty(2, 2, dtype=dtype))
    dense = [PackedCpuLinear(torch.randn(OUT, IN).to(dtype)) for _ in range(COUNT)] if packs else []
    q_bytes = sum(t.numel() * t.element_size() for t in weights[0])
    for rows in args.rows:
        x = torch.randn(rows, IN).to(dtype)
        quant_s = per_call(
            lambda x=x: [ops.quant_linear(x, *w, args.bits, 32, None, True, t) for w, t in zip(weights, tiles)], COUNT
        )
        path = f"{ops.quant_linear_isa()}{' tiles' if args.tiles else ''}"
        line = (
            f"{path}, {args.bits}-bit, {args.dtype} rows, threads {torch.get_num_threads()}, "
            f"rows {rows}: quant_linear {quant_s * 1e3:.3f} ms ({q_bytes / quant_s / 1e9:.1f} GB/s of weights)"
        )
        if dense:
            dense_s = per_call(lambda x=x: [d(x) for d in dense], COUNT)
            line += f"; oneDNN {args.dtype} {dense_s * 1e3:.3f} ms (quant / dense {quant_s / dense_s:.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
