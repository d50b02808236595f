"""Front-end capacity (#12): requests/s of tiny requests (a short prompt, max_new_tokens 1)
with 1 and 2 tokenizer workers, in one run; non-streaming and streaming /generate.

    .venv/bin/python benchmarks/front_end.py --model-path DIR [--workers 1 2]
        [--num-requests 1000] [--concurrency 64]

Each worker count gets a fresh server; the client keeps `--concurrency` connections open
(kept alive, so they spread over the workers when opened) and sends every request once.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx

from tandem.utils.process import free_port


async def _phase(base_url: str, num_requests: int, concurrency: int, stream: bool) -> float:
    """Requests/s of `num_requests` tiny /generate requests, `concurrency` at a time."""
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "stream": stream}
    todo = iter(range(num_requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as ac:

        async def client() -> None:
            for _ in todo:
                if stream:
                    async with ac.stream("POST", "/generate", json=body) as r:
                        assert r.status_code == 200
                        await r.aread()
                else:
                    r = await ac.post("/generate", json=body)
                    assert r.status_code == 200, r.text

        tic = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return num_requests / (time.perf_counter() - tic)


def _serve(model_path: str, workers: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.launch_server",
            "--model-path",
            model_path,
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--tokenizer-worker-num",
            str(workers),
        ]
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server not ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    print("| tokenizer workers | non-streaming req/s | streaming req/s |\n|---|---|---|")
    for n in args.workers:
        proc, base_url = _serve(args.model_path, n)
        try:
            asyncio.run(_phase(base_url, 100, args.concurrency, False))  # warm-up
            plain = asyncio.run(_phase(base_url, args.num_requests, args.concurrency, False))
            streamed = asyncio.run(_phase(base_url, args.num_requests, args.concurrency, True))
            print(f"| {n} | {plain:.0f} | {streamed:.0f} |", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
