"""Smoke run of `bench_offline_throughput` on the tiny model, as users run it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_offline_throughput_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "offline.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.bench_offline_throughput",
            "--model-path",
            str(tiny_llama_dir),
            "--num-prompts",
            "6",
            "--random-input-len",
            "24",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "1.0",
            "--max-running-requests",
            "4",
            "--output-file",
            str(out),
            "--tag",
            "smoke",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Offline Throughput Benchmark Result" in proc.stdout
    [line] = out.read_text().splitlines()
    r = json.loads(line)
    assert r["tag"] == "smoke" and r["max_running_requests"] == 4
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_input_tokens"] == 6 * 24
    assert r["total_output_tokens"] == 6 * 5
    for key in ("duration", "request_throughput", "input_throughput", "output_throughput", "total_throughput"):
        assert r[key] > 0, key
