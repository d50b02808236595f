"""Text report lines shared by `bench_serving` and `bench_offline_throughput` (SGLang's
layout: a 40-character label column, then the value)."""

from __future__ import annotations

from typing import Any


def report_row(name: str, value: Any, fmt: str = "") -> str:
    return f"{name:<40} {value:{fmt}}" if fmt else f"{name:<40} {value}"


def run_summary_rows(r: dict[str, Any], with_cached_tokens: bool) -> list[str]:
    """Request counts, duration, token totals and throughputs of one run's record."""
    rows = [
        report_row("Successful requests:", r["completed"]),
        report_row("Failed requests:", r["failed"]),
        report_row("Benchmark duration (s):", r["duration"], ".2f"),
        report_row("Total input tokens:", r["total_input_tokens"]),
        report_row("Total generated tokens:", r["total_output_tokens"]),
    ]
    if with_cached_tokens:
        rows.append(report_row("Total cached prompt tokens:", r["total_cached_tokens"]))
    return rows + [
        report_row("Request throughput (req/s):", r["request_throughput"], ".2f"),
        report_row("Input token throughput (tok/s):", r["input_throughput"], ".2f"),
        report_row("Output token throughput (tok/s):", r["output_throughput"], ".2f"),
        report_row("Total token throughput (tok/s):", r["total_throughput"], ".2f"),
    ]
