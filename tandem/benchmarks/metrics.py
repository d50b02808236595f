"""Metric math of `bench_serving`, as pure functions (SGLang's definitions).

Per request, from the send time `start` and the arrival time of every streamed chunk
that carried new output tokens:
  TTFT  first such chunk - start.
  ITL   inter-token latencies. The gap between two consecutive chunks is split evenly
        over the tokens the later chunk brought (k new tokens -> k entries of gap / k),
        as SGLang's bench_serving does. Tokens that arrive in the first chunk get no
        ITL entry (they are covered by TTFT), so a request has
        output_len - tokens_in_first_chunk entries summing to last chunk - first chunk.
  E2E   end of the response - start.
  TPOT  (E2E - TTFT) / (output_len - 1); only for requests with output_len > 1.
Over a run of duration D (first send to last response):
  request throughput = completed / D;  input / output token throughput = tokens / D;
  total token throughput = (input + output tokens) / D.
  total cached tokens = sum of the prompt tokens the server reported as served from its
  prefix cache (`meta_info.cached_tokens`, or OpenAI `usage.prompt_tokens_details`);
  prompt tokens computed = total input tokens - total cached tokens.
Summaries are mean, median and p99 (numpy's linear-interpolation percentile), in ms
for latencies; an empty list summarizes to 0.0, as in SGLang.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    """What one benchmark request measured; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e_latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    # Prompt tokens the server reported as reused from its prefix cache (0 if not reported).
    cached_tokens: int = 0


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """{"mean", "median", "p99"} of `values` multiplied by `scale`; zeros when empty."""
    if len(values) == 0:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def ttft_and_itl(start: float, chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> tuple[float, list[float]]:
    """TTFT and the ITL entries of one request from its chunks (see the module docstring).

    `chunk_times[i]` is when chunk i arrived, `chunk_tokens[i]` how many new output
    tokens it carried; chunks with no new tokens are ignored.
    """
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError("chunk_times and chunk_tokens must have the same length")
    ttft: float | None = None
    last = 0.0
    itl: list[float] = []
    for t, k in zip(chunk_times, chunk_tokens):
        if k <= 0:
            continue
        if ttft is None:
            ttft = t - start
        else:
            itl.extend([(t - last) / k] * k)
        last = t
    if ttft is None:
        raise ValueError("no chunk carried an output token")
    return ttft, itl


def tpot(e2e_latency: float, ttft: float, output_len: int) -> float | None:
    """Time per output token after the first; None when output_len <= 1."""
    if output_len <= 1:
        return None
    return (e2e_latency - ttft) / (output_len - 1)


def throughput(count: float, duration: float) -> float:
    """Items per second; 0.0 for a non-positive duration."""
    return count / duration if duration > 0 else 0.0


def compute_metrics(results: Iterable[RequestResult], duration: float) -> dict[str, float | int]:
    """The report of one run: counts, throughputs and latency summaries (ms)."""
    results = list(results)
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot(r.e2e_latency, r.ttft, r.output_len)) is not None]
    itls = [x for r in ok for x in r.itl]
    out: dict[str, float | int] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": total_cached,
        "prompt_tokens_computed": total_input - total_cached,
        "request_throughput": throughput(len(ok), duration),
        "input_throughput": throughput(total_input, duration),
        "output_throughput": throughput(total_output, duration),
        "total_throughput": throughput(total_input + total_output, duration),
        # Mean number of requests in flight (SGLang's "concurrency").
        "concurrency": throughput(sum(r.e2e_latency for r in ok), duration),
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", itls),
        ("e2e_latency", [r.e2e_latency for r in ok]),
    ):
        for stat, v in summarize(values, scale=1000.0).items():
            out[f"{stat}_{name}_ms"] = v
    return out
