"""Weight-update latency (#12): how long the offline Engine takes to swap in new weights
of the same architecture, from disk and from tensors, and to answer get_weights_by_name.

    .venv/bin/python benchmarks/weight_update.py [--preset 100m] [--repeats 3] [--tp-size 1]
        [--work-dir /tmp/tandem-weight-update]

Two random-weight models of `--preset` (seeds 0 and 1, written once into `--work-dir`)
serve as A and B. An idle Engine on A alternates between them: each call is timed from
the caller's side (pause, load, prepare the packed kernels, swap, flush, reply). The
tensors of a from-tensor update are loaded into host memory before the clock starts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from safetensors.torch import load_file

from tandem.tools.make_tiny_model import make_tiny_model


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        ok, message = fn()
        times.append(time.perf_counter() - tic)
        assert ok, message
    return times


def _row(what: str, times: list[float]) -> str:
    return f"| {what} | {statistics.median(times) * 1000:.0f} | {min(times) * 1000:.0f} |"


def main() -> None:
    from tandem import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--work-dir", default="/tmp/tandem-weight-update")
    args = ap.parse_args()

    work = Path(args.work_dir)
    models = []
    for seed in (0, 1):
        path = work / f"{args.preset}-seed{seed}"
        models.append(
            path
            if (path / "config.json").exists()
            else make_tiny_model(path, arch="llama", preset=args.preset, seed=seed)
        )
    a, b = (str(m) for m in models)
    tensors = [list(load_file(str(m / "model.safetensors")).items()) for m in models]
    size_mb = sum(t.numel() * t.element_size() for _, t in tensors[1]) / 2**20

    name = "model.embed_tokens.weight"

    def get_weights(engine) -> tuple[bool, str]:
        engine.get_weights_by_name(name, truncate_size=10)
        return True, ""

    with Engine(model_path=a, tp_size=args.tp_size) as engine:
        flip = iter(range(10**9))
        disk = _timed(lambda: engine.update_weights_from_disk(b if next(flip) % 2 == 0 else a), args.repeats)
        get_disk = _timed(lambda: get_weights(engine), args.repeats)
        flip = iter(range(10**9))
        tensor = _timed(lambda: engine.update_weights_from_tensor(tensors[next(flip) % 2]), args.repeats)
        get_tensor = _timed(lambda: get_weights(engine), args.repeats)

    print(f"preset {args.preset}, tp {args.tp_size}, {size_mb:.0f} MB of weights, {args.repeats} repeats")
    print("| call | median ms | min ms |")
    print("|---|---|---|")
    print(_row("update_weights_from_disk", disk))
    print(_row("update_weights_from_tensor (every tensor)", tensor))
    print(_row(f"get_weights_by_name({name}, 10), weights from disk", get_disk))
    print(_row(f"get_weights_by_name({name}, 10), weights from tensors", get_tensor))


if __name__ == "__main__":
    main()
