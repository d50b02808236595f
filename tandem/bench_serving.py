"""Load generator for a running LLM server: `python -m tandem.bench_serving`.

Flag names follow SGLang's `python -m sglang.bench_serving`, so the same command line
measures Tandem, SGLang and vLLM. Prompts are random token ids (special tokens left
out) sent as ids, and `ignore_eos` fixes every output length, so each engine does the
same work. Example::

    python -m tandem.bench_serving --backend tandem --base-url http://127.0.0.1:30000 \\
        --num-prompts 16 --random-input-len 128 --random-output-len 128 --random-range-ratio 0.5

Server:
  --backend tandem|sglang|vllm|openai
                        tandem, sglang: native `POST /generate` with `input_ids`,
                        `sampling_params` {max_new_tokens, temperature 0, ignore_eos true},
                        `stream` true. vllm, openai: `POST /v1/completions` with `prompt`
                        as a list of token ids, `max_tokens`, `temperature` 0, `ignore_eos`
                        true (a vLLM extra), `stream` true, `stream_options.include_usage`.
  --base-url URL        Server address, e.g. http://127.0.0.1:30000 (overrides the two below).
  --host HOST           Default 127.0.0.1.
  --port PORT           Default 30000 for tandem/sglang, 8000 for vllm/openai.
  --model NAME          Model name sent to OpenAI-style backends (default: the first id of
                        GET /v1/models). A directory here also serves as the tokenizer.
  --tokenizer DIR       Tokenizer (model) directory, used only to know the vocabulary and
                        its special ids. Default: --model if it is a directory, else the
                        path the server reports (GET /model_info for tandem/sglang, the
                        `root` of GET /v1/models for vllm/openai) when it exists here.
  --extra-request-body JSON
                        Extra fields merged into every request body (into `sampling_params`
                        for tandem/sglang).

Workload:
  --dataset-name random|shared-prefix     (`generated-shared-prefix` is accepted too)
  --num-prompts N       Requests of the random dataset (default 1000).
  --random-input-len N, --random-output-len N
                        Prompt / output length of the random dataset (default 1024 / 128).
  --random-range-ratio R
                        Lengths uniform in [max(1, int(R * len)), len] (default 0.0; 1.0
                        gives fixed lengths).
  --gsp-num-groups N (alias --shared-prefix-groups)      groups (default 8)
  --gsp-prompts-per-group N (alias --questions-per-group) prompts per group (default 16)
  --gsp-system-prompt-len N (alias --shared-prefix-len)  shared prefix tokens (default 1024)
  --gsp-question-len N  tokens after the prefix, each prompt its own (default 128)
  --gsp-output-len N    output tokens of each prompt (default 128)
                        The shared-prefix dataset has groups x prompts-per-group requests
                        (it ignores --num-prompts) in shuffled order.
  --seed N              Seed of the prompts and of the arrival times (default 1).

Load:
  --request-rate R      Requests per second, Poisson arrivals (exponential gaps);
                        `inf` (default) sends all at once.
  --max-concurrency N   At most N requests in flight; later arrivals wait for a slot.
  --warmup-requests N   Requests sent one at a time before the run, not measured
                        (default 1; output capped at 16 tokens).

Output:
  --output-file PATH    Append one JSON line per run: the settings and every metric.
  --tag TEXT            Free-form label stored in the JSON line.
  --disable-tqdm        No progress bar.

Metrics (definitions in `tandem.benchmarks.metrics`): completed / failed requests,
request throughput, input / output / total token throughput, and mean / median / p99 of
TTFT, TPOT, ITL and end-to-end latency, and the prompt tokens served from the server's
prefix cache (`meta_info.cached_tokens`; OpenAI `usage.prompt_tokens_details.cached_tokens`
where the server reports it, else 0). Output tokens are counted from the server's
cumulative `meta_info.completion_tokens` (falling back to the length of the cumulative
`output_ids`) for tandem/sglang, and from `usage.completion_tokens` for OpenAI-style
backends. A chunk may carry several tokens: its gap to the previous chunk is split
evenly over them (SGLang's rule). OpenAI chunks carry no token count: each chunk with a
choice counts as one token, except a final chunk with a finish reason and no text.
The HTTP client ignores proxy settings from the environment and has no connection cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.benchmarks.datasets import (
    BenchRequest,
    arrival_offsets,
    generate_random_requests,
    generate_shared_prefix_requests,
    load_token_space,
)
from tandem.benchmarks.metrics import RequestResult, compute_metrics, ttft_and_itl
from tandem.benchmarks.report import report_row, run_summary_rows

NATIVE_BACKENDS = ("tandem", "sglang")
OPENAI_BACKENDS = ("vllm", "openai")
WARMUP_MAX_OUTPUT = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tandem.bench_serving",
        description="Benchmark the online serving throughput and latency of a running server.",
    )
    p.add_argument("--backend", choices=NATIVE_BACKENDS + OPENAI_BACKENDS, default="tandem")
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request.")
    p.add_argument("--dataset-name", choices=("random", "shared-prefix", "generated-shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", "--shared-prefix-groups", dest="gsp_num_groups", type=int, default=8)
    p.add_argument(
        "--gsp-prompts-per-group", "--questions-per-group", dest="gsp_prompts_per_group", type=int, default=16
    )
    p.add_argument(
        "--gsp-system-prompt-len", "--shared-prefix-len", dest="gsp_system_prompt_len", type=int, default=1024
    )
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None)
    p.add_argument("--tag", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.dataset_name == "generated-shared-prefix":
        args.dataset_name = "shared-prefix"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf for all at once)")
    try:
        args.extra_request_body = json.loads(args.extra_request_body) if args.extra_request_body else {}
    except ValueError as e:
        p.error(f"--extra-request-body: invalid JSON ({e})")
    if not isinstance(args.extra_request_body, dict):
        p.error("--extra-request-body must be a JSON object")
    return args


def base_url_of(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port or (30000 if args.backend in NATIVE_BACKENDS else 8000)
    return f"http://{args.host}:{port}"


# ---- server discovery --------------------------------------------------------------
async def _get_json(client: httpx.AsyncClient, url: str) -> Any | None:
    try:
        r = await client.get(url, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def resolve_model_name(client: httpx.AsyncClient, args: argparse.Namespace, base_url: str) -> str | None:
    if args.model or args.backend in NATIVE_BACKENDS:
        return args.model
    models = await _get_json(client, base_url + "/v1/models")
    try:
        return models["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        raise SystemExit(f"--model not given and GET {base_url}/v1/models named no model") from None


async def resolve_tokenizer(
    client: httpx.AsyncClient, args: argparse.Namespace, base_url: str, model: str | None
) -> str:
    candidates = [args.tokenizer, args.model]
    if args.tokenizer is None:
        if args.backend in NATIVE_BACKENDS:
            for route in ("/model_info", "/get_model_info"):
                info = await _get_json(client, base_url + route)
                if isinstance(info, dict):
                    candidates += [info.get("tokenizer_path"), info.get("model_path")]
                    break
        else:
            models = await _get_json(client, base_url + "/v1/models")
            for m in (models or {}).get("data", [])[:1]:
                candidates += [m.get("root"), m.get("id")]
            candidates.append(model)
    for path in candidates:
        if path and (os.path.isdir(path) or path.endswith(".gguf") and os.path.isfile(path)):
            return path
    if args.tokenizer:
        raise SystemExit(f"--tokenizer: {args.tokenizer} is not a directory")
    raise SystemExit("could not find the model's tokenizer directory; pass --tokenizer DIR")


# ---- requests ----------------------------------------------------------------------
@dataclass
class Target:
    backend: str
    url: str
    model: str | None
    extra: dict[str, Any]


def make_target(backend: str, base_url: str, model: str | None, extra: dict[str, Any]) -> Target:
    route = "/generate" if backend in NATIVE_BACKENDS else "/v1/completions"
    return Target(backend, base_url + route, model, extra)


def build_payload(target: Target, req: BenchRequest) -> dict[str, Any]:
    if target.backend in NATIVE_BACKENDS:
        extra = dict(target.extra)
        sampling = {
            "max_new_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            **extra.pop("sampling_params", {}),
            **extra,
        }
        return {"input_ids": req.prompt_ids, "sampling_params": sampling, "stream": True}
    payload = {
        "prompt": req.prompt_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.model:
        payload["model"] = target.model
    payload.update(target.extra)
    return payload


class _Stream:
    """Per-request chunk bookkeeping: arrival times and new-token counts."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.total = 0
        self.cached = 0

    def add(self, t: float, new_tokens: int) -> None:
        if new_tokens > 0:
            self.times.append(t)
            self.tokens.append(new_tokens)
            self.total += new_tokens


def _native_chunk(data: dict, stream: _Stream, now: float) -> str | None:
    """Record one /generate chunk; return an error message if the chunk reports one."""
    if "error" in data:
        err = data["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    meta = data.get("meta_info") or {}
    count = meta.get("completion_tokens")
    if count is None:
        count = len(data.get("output_ids") or [])
    stream.add(now, int(count) - stream.total)
    if meta.get("cached_tokens") is not None:
        stream.cached = int(meta["cached_tokens"])
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return f"aborted: {reason.get('message', '')}"
    return None


def _openai_chunk(data: dict, stream: _Stream, now: float, usage: dict) -> str | None:
    if "error" in data:
        err = data["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    if data.get("usage"):
        usage.update(data["usage"])
    choices = data.get("choices") or []
    if choices:
        choice = choices[0]
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            stream.add(now, len(ids))
        elif choice.get("text") or choice.get("finish_reason") is None:
            stream.add(now, 1)
    return None


async def send_request(client: httpx.AsyncClient, target: Target, req: BenchRequest) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    stream = _Stream()
    usage: dict = {}
    error = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=build_payload(target, req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:500]}"
                return result
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                chunk = line[5:].strip()
                if chunk == "[DONE]":
                    break
                data = json.loads(chunk)
                if target.backend in NATIVE_BACKENDS:
                    error = _native_chunk(data, stream, now)
                else:
                    error = _openai_chunk(data, stream, now, usage)
                if error:
                    break
        result.e2e_latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - any failure is a failed request
        result.error = f"{type(e).__name__}: {e}"
        return result
    if error:
        result.error = error
        return result
    if not stream.times:
        result.error = "the response carried no output tokens"
        return result
    result.ttft, result.itl = ttft_and_itl(start, stream.times, stream.tokens)
    result.output_len = int(usage.get("completion_tokens", stream.total))
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens") or 0) if details else stream.cached
    result.success = True
    return result


# ---- the run -----------------------------------------------------------------------
def build_requests(args: argparse.Namespace, tokenizer_path: str) -> list[BenchRequest]:
    space = load_token_space(tokenizer_path)
    if args.dataset_name == "random":
        return generate_random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            space,
            seed=args.seed,
        )
    return generate_shared_prefix_requests(
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        space,
        seed=args.seed,
    )


async def run_requests(
    client: httpx.AsyncClient,
    target: Target,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    disable_tqdm: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every request at its Poisson arrival time (at most `max_concurrency` in
    flight); return the results in request order and the run's duration in seconds."""
    from tqdm.auto import tqdm

    offsets = arrival_offsets(len(requests), request_rate, seed=seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = None if disable_tqdm else tqdm(total=len(requests), desc="requests")
    start = time.perf_counter()

    async def one(i: int, req: BenchRequest) -> RequestResult:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            res = await send_request(client, target, req)
        else:
            async with sem:
                res = await send_request(client, target, req)
        if pbar is not None:
            pbar.update(1)
        return res

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return list(results), duration


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = base_url_of(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = await resolve_model_name(client, args, base_url)
        tokenizer_path = await resolve_tokenizer(client, args, base_url, model)
        requests = build_requests(args, tokenizer_path)
        target = make_target(args.backend, base_url, model, args.extra_request_body)

        for _ in range(args.warmup_requests):
            warm = requests[0]
            res = await send_request(
                client, target, BenchRequest(warm.prompt_ids, min(warm.output_len, WARMUP_MAX_OUTPUT))
            )
            if not res.success:
                raise SystemExit(f"warm-up request failed: {res.error}")

        results, duration = await run_requests(
            client, target, requests, args.request_rate, args.max_concurrency, args.seed, args.disable_tqdm
        )
    metrics = compute_metrics(results, duration)
    errors = sorted({r.error for r in results if not r.success})
    record = {
        "tag": args.tag,
        "backend": args.backend,
        "base_url": base_url,
        "model": model,
        "tokenizer": tokenizer_path,
        "dataset_name": args.dataset_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "timestamp": time.time(),
    }
    if args.dataset_name == "random":
        record.update(
            random_input_len=args.random_input_len,
            random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio,
        )
    else:
        record.update(
            gsp_num_groups=args.gsp_num_groups,
            gsp_prompts_per_group=args.gsp_prompts_per_group,
            gsp_system_prompt_len=args.gsp_system_prompt_len,
            gsp_question_len=args.gsp_question_len,
            gsp_output_len=args.gsp_output_len,
        )
    record.update(metrics)
    record["errors"] = errors[:5]
    return record


def format_report(r: dict[str, Any]) -> str:
    row = report_row
    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        row("Backend:", r["backend"]),
        row("Traffic request rate:", r["request_rate"]),
        row("Max request concurrency:", r["max_concurrency"] or "not set"),
        *run_summary_rows(r, with_cached_tokens=True),
        row("Concurrency:", r["concurrency"], ".2f"),
    ]
    for title, key in (
        ("End-to-End Latency", "e2e_latency"),
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-Token Latency", "itl"),
    ):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        label = {"e2e_latency": "E2E Latency"}.get(key, key.upper())
        for stat in ("mean", "median", "p99"):
            lines.append(
                row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms):", r[f"{stat}_{key}_ms"], ".2f")
            )
    lines.append("=" * 50)
    if r["errors"]:
        lines.append("errors: " + " | ".join(r["errors"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        record = asyncio.run(benchmark(args))
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(format_report(record), flush=True)
    return 0 if record["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
