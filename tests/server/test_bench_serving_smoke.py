"""Smoke runs of the benchmark tools on the tiny model: `bench_serving` against a real
server (as a subprocess, the way users run it) and `bench_one_batch` in-process."""

from __future__ import annotations

import json
import subprocess
import sys

from server_launcher import ServerHandle

from tandem import bench_one_batch


def test_bench_serving_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.jsonl"
    with ServerHandle(tiny_llama_dir) as server:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem.bench_serving",
                "--backend",
                "tandem",
                "--base-url",
                server.base_url,
                "--num-prompts",
                "8",
                "--random-input-len",
                "32",
                "--random-output-len",
                "8",
                "--random-range-ratio",
                "1.0",
                "--output-file",
                str(out),
                "--disable-tqdm",
                "--tag",
                "smoke",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    [line] = out.read_text().splitlines()
    r = json.loads(line)
    assert r["tag"] == "smoke" and r["backend"] == "tandem"
    assert r["completed"] == 8 and r["failed"] == 0 and r["errors"] == []
    assert r["total_input_tokens"] == 8 * 32
    assert r["total_output_tokens"] == 64
    for key in (
        "duration",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2e_latency_ms",
        "p99_e2e_latency_ms",
    ):
        assert r[key] > 0, key
    assert r["mean_e2e_latency_ms"] >= r["mean_ttft_ms"]


def test_bench_one_batch_smoke(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "one_batch.jsonl"
    rc = bench_one_batch.main(
        [
            "--model-path",
            str(tiny_llama_dir),
            "--batch-size",
            "1",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--output-file",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prefill tok/s" in printed and "x floor" in printed and "memory bandwidth" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["input_len"] == 16 and r["output_len"] == 4
        for key in (
            "prefill_latency",
            "prefill_throughput",
            "median_decode_latency",
            "median_decode_throughput",
            "total_latency",
            "overall_throughput",
            "decode_floor",
            "floor_multiple",
        ):
            assert r[key] > 0, key


def test_bench_one_batch_frees_kv_and_generates(tiny_llama_dir):
    args = bench_one_batch.parse_args(
        [
            "--model-path",
            str(tiny_llama_dir),
            "--batch-size",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--device",
            "cpu",
        ]
    )
    bench = bench_one_batch.OneBatchBench(bench_one_batch.resolve_server_args(args))
    pool = bench.runner.token_to_kv_pool
    total = pool.available_size()
    assert total == 2 * (8 + 5)
    res = bench.run_once(2, 8, 5)
    assert res.batch_size == 2 and res.total_latency > 0
    assert pool.available_size() == total
