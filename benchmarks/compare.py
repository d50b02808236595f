"""Tandem side by side with vLLM, SGLang and HF transformers, one engine after another.

    .venv/bin/python benchmarks/compare.py                    # the full matrix (see --help)
    .venv/bin/python benchmarks/compare.py --quick --models 7m --workloads a,b --engines tandem,hf

For each model preset (built once with `tandem.tools.make_tiny_model` into --model-dir)
and each engine present, it starts the engine's server on that model, runs the
workloads `--repeats` times with `tandem.bench_serving`'s request code (in-process:
its dataset generators, `send_request`, `run_requests` and `compute_metrics`), stops the
server (its whole process group and every descendant), and moves on. HF transformers
runs in this process: `generate` on left-padded batches of the same prompts (greedy,
`min_new_tokens == max_new_tokens`, so lengths match), one batch per `max_concurrency`
slice, with step times taken from a streamer. It writes the raw rows (--results-jsonl),
a markdown report with the tables (--out) and a plot next to it (.png). A full run (not
--quick, at least 3 repeats) also rewrites docs/benchmarks.md (--doc) and its plot: the
whole page but its generated sections (GGUF, moe_decode.py, lora.py, speculative.py), which
it keeps.

Workloads (token-id prompts, `ignore_eos`, so every engine does the same work):
  a  16 concurrent requests: random prompts of 64-128 tokens (bench_serving's random
     dataset, --random-input-len 128 --random-range-ratio 0.5), 128 output tokens each.
  b  one request at a time: 128 prompt tokens, 128 output tokens.
  c  200 requests arriving as a Poisson process at a fixed rate (--rate), 64-128 prompt
     tokens, 32 output tokens: TTFT / TPOT / ITL percentiles. Not run for HF (no server).
  d  shared prefix (bench_serving's shared-prefix dataset): groups of prompts sharing a
     512-token system prompt, each with its own 64-token question, 32 output tokens,
     16 in flight.
  e  as (a) with 64 concurrent requests.
Every engine runs each model in each of --dtypes (float32 and bfloat16 by default); a
table row is one model in one dtype ("100m bf16").
Output lengths are fixed (bench_serving's range ratio applies to both lengths; here it
applies to the prompts only). Each repeat uses its own seed, so no prompt of one run is
in a prefix cache filled by another. Tandem extra: workload d with
`--disable-radix-cache` against the default, reporting the ratio of prompt tokens
computed (sum of prompt_tokens - cached_tokens) and of wall time.

GGUF mode (`--gguf`, #23): instead of the presets, the default model's GGUF file
(--gguf-source) and the files llama-quantize makes from it once (--gguf-formats: Q4_0, Q8_0,
Q4_K_M, BF16 by default; cached in models/gguf-bench). Per file, one after another:
llama.cpp's `llama-bench` (raw prefill / decode tok/s), Tandem with default flags, Tandem
with `--linear-backend torch` (bf16, dequantized; on --gguf-dequant files), and llama.cpp's
`llama-server` (`/v1/completions` with `ignore_eos` and `logit_bias` on the EOS ids), on
workloads b, a and e. A full run rewrites its generated section of docs/benchmarks.md
(between GGUF_DOC_BEGIN and GGUF_DOC_END; a smoke run only writes --out):

    .venv/bin/python benchmarks/compare.py --gguf                                     # ~50 min
    .venv/bin/python benchmarks/compare.py --gguf --quick --gguf-formats q4_1         # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem import bench_serving  # noqa: E402
from tandem.benchmarks import report  # noqa: E402
from tandem.benchmarks.datasets import (  # noqa: E402
    BenchRequest,
    TokenSpace,
    generate_random_requests,
    generate_shared_prefix_requests,
    load_token_space,
)
from tandem.benchmarks.metrics import RequestResult, compute_metrics  # noqa: E402
from tandem.benchmarks.report import git_rev, machine_info  # noqa: E402
from tandem.utils.process import free_port, pid_alive  # noqa: E402

ENGINES = ("tandem", "vllm", "sglang", "hf")
PEER_ENGINES = ("vllm", "sglang")
NORADIX = "tandem-noradix"  # Tandem with --disable-radix-cache, workload d only
DEQUANT = "tandem-dequant"  # GGUF mode: Tandem with --linear-backend torch (weights dequantized to bf16)
LLAMACPP = "llamacpp"  # GGUF mode: llama.cpp's llama-server
ENGINE_LABELS = {
    "tandem": "Tandem",
    "vllm": "vLLM",
    "sglang": "SGLang",
    "hf": "HF transformers",
    NORADIX: "Tandem --disable-radix-cache",
    DEQUANT: "Tandem --linear-backend torch (bf16, dequantized)",
    LLAMACPP: "llama.cpp llama-server",
}
BACKENDS = {
    "tandem": "tandem",
    NORADIX: "tandem",
    "sglang": "sglang",
    "vllm": "vllm",
    DEQUANT: "tandem",
    LLAMACPP: "openai",
}
START_TIMEOUT = {"tandem": 300.0, NORADIX: 300.0, "sglang": 600.0, "vllm": 900.0, DEQUANT: 300.0, LLAMACPP: 120.0}
DEFAULT_RATES = {"7m": 4.0, "100m": 1.5}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # --dtypes value -> short name in a row's model label
THROUGHPUT_WORKLOADS = ("a", "e", "d", "b")  # workloads whose output tok/s is compared with the best peer


def model_label(preset: str, dtype: str) -> str:
    """One table row's model: the preset and the dtype it ran in ("100m bf16")."""
    return f"{preset} {DTYPES[dtype]}"


def preset_of(label: str) -> str:
    return label.split()[0]


# ---- workloads ---------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    dataset: str  # "random" | "shared-prefix"
    num_prompts: int = 0
    input_len: int = 128
    range_ratio: float = 1.0
    output_len: int = 128
    request_rate: float = math.inf
    max_concurrency: int | None = None
    gsp_num_groups: int = 0
    gsp_prompts_per_group: int = 0
    gsp_system_prompt_len: int = 0
    gsp_question_len: int = 0

    def requests(self, space: TokenSpace, seed: int) -> list[BenchRequest]:
        if self.dataset == "random":
            reqs = generate_random_requests(
                self.num_prompts, self.input_len, self.output_len, self.range_ratio, space, seed=seed
            )
            return [BenchRequest(r.prompt_ids, self.output_len) for r in reqs]
        return generate_shared_prefix_requests(
            self.gsp_num_groups,
            self.gsp_prompts_per_group,
            self.gsp_system_prompt_len,
            self.gsp_question_len,
            self.output_len,
            space,
            seed=seed,
        )

    def bench_serving_flags(self) -> str:
        """The bench_serving flags of the same workload (its range ratio also applies to
        output lengths, which this script keeps fixed)."""
        load = []
        if not math.isinf(self.request_rate):
            load.append(f"--request-rate {self.request_rate:g}")
        if self.max_concurrency:
            load.append(f"--max-concurrency {self.max_concurrency}")
        if self.dataset == "random":
            data = (
                f"--dataset-name random --num-prompts {self.num_prompts} --random-input-len {self.input_len} "
                f"--random-range-ratio {self.range_ratio:g} --random-output-len {self.output_len}"
            )
        else:
            data = (
                f"--dataset-name shared-prefix --gsp-num-groups {self.gsp_num_groups} "
                f"--gsp-prompts-per-group {self.gsp_prompts_per_group} "
                f"--gsp-system-prompt-len {self.gsp_system_prompt_len} "
                f"--gsp-question-len {self.gsp_question_len} --gsp-output-len {self.output_len}"
            )
        return " ".join([data, *load])


def make_workloads(quick: bool, rate: float) -> dict[str, Workload]:
    return {
        "a": Workload(
            "a",
            "16 concurrent requests, 64-128 in / 128 out",
            "random",
            num_prompts=16 if quick else 48,
            input_len=128,
            range_ratio=0.5,
            output_len=128,
            max_concurrency=16,
        ),
        "b": Workload(
            "b",
            "1 request at a time, 128 in / 128 out",
            "random",
            num_prompts=2 if quick else 4,
            input_len=128,
            range_ratio=1.0,
            output_len=128,
            max_concurrency=1,
        ),
        "c": Workload(
            "c",
            f"{40 if quick else 200} requests at a fixed rate (Poisson), 64-128 in / 32 out",
            "random",
            num_prompts=40 if quick else 200,
            input_len=128,
            range_ratio=0.5,
            output_len=32,
            request_rate=rate,
        ),
        "d": Workload(
            "d",
            "shared prefix: 512-token system prompt + 64-token question, 32 out, 16 in flight",
            "shared-prefix",
            output_len=32,
            max_concurrency=16,
            gsp_num_groups=2 if quick else 4,
            gsp_prompts_per_group=8,
            gsp_system_prompt_len=512,
            gsp_question_len=64,
        ),
        "e": Workload(
            "e",
            "64 concurrent requests, 64-128 in / 128 out",
            "random",
            num_prompts=64 if quick else 128,
            input_len=128,
            range_ratio=0.5,
            output_len=128,
            max_concurrency=64,
        ),
    }


# ---- servers -----------------------------------------------------------------------
LIVE_SERVERS: set[Server] = set()


class Server:
    """One engine's HTTP server in its own session (process group); `stop` ends the group
    and every descendant that left it."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int):
        self.name, self.cmd, self.port = name, cmd, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(REPO)
        )
        self.pgid = self.proc.pid
        self.pids: set[int] = {self.proc.pid}
        LIVE_SERVERS.add(self)

    def _collect_descendants(self) -> None:
        try:
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])

    def wait_ready(self, timeout: float) -> float:
        """Poll GET /health until 200; return the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            self._collect_descendants()
            try:
                if httpx.get(self.base_url + "/health", timeout=5, trust_env=False).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM the process group, wait, SIGKILL what is left (group and strays);
        return the pids that needed SIGKILL."""
        LIVE_SERVERS.discard(self)
        self._collect_descendants()
        try:
            os.killpg(self.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.pids):
            time.sleep(0.2)
        killed = [p for p in sorted(self.pids) if pid_alive(p)]
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pid in killed:
            deadline = time.monotonic() + 5
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        self._log.close()
        return killed


def stop_all_servers(*_: Any) -> None:
    for server in list(LIVE_SERVERS):
        server.stop(timeout=10)


def _on_signal(signum: int, _frame: Any) -> None:
    stop_all_servers()
    raise SystemExit(128 + signum)


def server_command(
    engine: str, model_dir: Path, port: int, dtype: str, args: argparse.Namespace
) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if engine in ("tandem", NORADIX, DEQUANT):
        cmd = [
            sys.executable,
            "-m",
            "tandem.launch_server",
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        if dtype != "auto":  # GGUF mode: Tandem's own default dtype
            cmd += ["--dtype", dtype]
        if engine == NORADIX:
            cmd.append("--disable-radix-cache")
        if engine == DEQUANT:
            cmd += ["--linear-backend", "torch"]
        return cmd, env
    if engine == LLAMACPP:
        return llama_server_command(model_dir, port, args), env
    env["PEERS_DIR"] = str(args.peers_dir)
    if engine == "vllm" and args.vllm_all_cores:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # serve.sh passes --dtype float32; a later --dtype wins.
    extra = ["--dtype", dtype]
    if engine == "vllm":
        extra.append("--enable-prompt-tokens-details")  # report cached prompt tokens
    return ["bash", str(args.peers_serve), engine, str(model_dir), str(port), *extra], env


def engine_available(engine: str, args: argparse.Namespace) -> str | None:
    """None when the engine can run here, else why not."""
    if engine in PEER_ENGINES:
        venv = {"vllm": "venv-vllm", "sglang": "venv-sgl"}[engine]
        if not (args.peers_dir / venv / "bin" / "python").exists():
            return f"{args.peers_dir / venv} not found (install with ../shared/peers/setup.sh)"
        if not args.peers_serve.exists():
            return f"{args.peers_serve} not found"
    return None


def engine_version(engine: str, args: argparse.Namespace) -> str:
    if engine in ("tandem", NORADIX, DEQUANT):
        return "this checkout (" + git_rev(REPO) + ")"
    if engine in (LLAMACPP, LLAMA_BENCH):
        return llamacpp_version(args)
    if engine == "hf":
        import torch
        import transformers

        return f"transformers {transformers.__version__}, torch {torch.__version__}"
    venv = {"vllm": "venv-vllm", "sglang": "venv-sgl"}[engine]
    code = (
        "from importlib.metadata import version as v\n"
        "out = []\n"
        "for d in ('vllm', 'vllm-cpu', 'sglang', 'torch'):\n"
        "    try: out.append(f'{d} {v(d)}')\n"
        "    except Exception: pass\n"
        "print(', '.join(out))"
    )
    try:
        res = subprocess.run(
            [str(args.peers_dir / venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60
        )
        return res.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# ---- running a workload against a server ------------------------------------------
async def _server_model_name(client: httpx.AsyncClient, backend: str, base_url: str) -> str | None:
    ns = argparse.Namespace(model=None, backend=backend)
    return await bench_serving.resolve_model_name(client, ns, base_url)


async def _http_run(
    backend: str,
    base_url: str,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    extra: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """`extra`: fields added to every request body (llama-server's `logit_bias`)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=60.0), trust_env=False) as client:
        model = await _server_model_name(client, backend, base_url)
        target = bench_serving.make_target(backend, base_url, model, dict(extra or {}))
        if warmup:
            results, _ = await bench_serving.run_requests(client, target, warmup, math.inf, None, seed)
            bad = [r.error for r in results if not r.success]
            if bad:
                raise RuntimeError(f"warm-up failed: {bad[0]}")
        if not requests:
            return [], 0.0
        return await bench_serving.run_requests(client, target, requests, rate, max_concurrency, seed)


def run_http_workload(
    backend: str, base_url: str, workload: Workload, space: TokenSpace, seed: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    requests = workload.requests(space, seed)
    # One warm-up request of its own (another seed), so prefix caches gain nothing from it.
    warm = generate_random_requests(1, 32, 8, 1.0, space, seed=seed + 7919)
    results, duration = asyncio.run(
        _http_run(backend, base_url, requests, warm, workload.request_rate, workload.max_concurrency, seed, extra)
    )
    metrics = compute_metrics(results, duration)
    metrics["errors"] = sorted({r.error for r in results if not r.success})[:3]
    # Requests that completed with another number of tokens than asked (EOS not ignored, or a
    # stream the client counted wrongly): every engine must do the same work.
    metrics["wrong_length"] = sum(1 for r, q in zip(results, requests) if r.success and r.output_len != q.output_len)
    return metrics


def warm_up_server(backend: str, base_url: str, space: TokenSpace, extra: dict[str, Any] | None = None) -> None:
    """Once per server start: 16 concurrent short requests, then one alone (first-batch
    compilation and allocation happen here, not in the measured runs)."""
    burst = generate_random_requests(16, 64, 16, 0.5, space, seed=424242)
    asyncio.run(_http_run(backend, base_url, [], burst, math.inf, None, 1, extra))
    asyncio.run(_http_run(backend, base_url, [], burst[:1], math.inf, None, 1, extra))


# ---- HF transformers, in-process ---------------------------------------------------
class HFRunner:
    """`generate` on left-padded batches: greedy, min_new_tokens == max_new_tokens."""

    def __init__(self, model_dir: Path, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
        cfg = self.model.config
        gen = self.model.generation_config
        pad = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else gen.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def _batch(self, reqs: list[BenchRequest]) -> list[RequestResult]:
        torch = self.torch
        from transformers.generation.streamers import BaseStreamer

        longest = max(r.prompt_len for r in reqs)
        ids = torch.full((len(reqs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, longest - r.prompt_len :] = torch.tensor(r.prompt_ids)
            mask[i, longest - r.prompt_len :] = 1
        new_tokens = max(r.output_len for r in reqs)
        times: list[float] = []

        class StepTimes(BaseStreamer):
            def __init__(self) -> None:
                self.first = True

            def put(self, value: Any) -> None:
                if self.first:  # the prompt
                    self.first = False
                    return
                times.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=StepTimes(),
            )
        end = time.perf_counter()
        produced = out.shape[1] - longest
        results = []
        for r in reqs:
            n = min(r.output_len, produced)
            steps = times[:n]
            itl = [b - a for a, b in zip(steps, steps[1:])]
            # A request shorter than the batch's longest is done at its own last token.
            e2e = (steps[-1] if steps and n < produced else end) - start
            results.append(
                RequestResult(
                    success=n == r.output_len,
                    prompt_len=r.prompt_len,
                    output_len=n,
                    ttft=(steps[0] - start) if steps else e2e,
                    e2e_latency=e2e,
                    itl=itl,
                    error="" if n == r.output_len else f"generated {n} of {r.output_len}",
                )
            )
        return results

    def run(self, workload: Workload, space: TokenSpace, seed: int) -> dict[str, Any]:
        requests = workload.requests(space, seed)
        self._batch(generate_random_requests(1, 32, 8, 1.0, space, seed=seed + 7919))  # warm-up
        size = workload.max_concurrency or len(requests)
        results: list[RequestResult] = []
        start = time.perf_counter()
        for i in range(0, len(requests), size):
            results += self._batch(requests[i : i + size])
        duration = time.perf_counter() - start
        metrics = compute_metrics(results, duration)
        metrics["errors"] = sorted({r.error for r in results if not r.success})[:3]
        return metrics

    def warm_up(self, space: TokenSpace) -> None:
        self._batch(generate_random_requests(16, 64, 16, 0.5, space, seed=424242))

    def close(self) -> None:
        del self.model
        gc.collect()


# ---- the matrix --------------------------------------------------------------------
@dataclass
class Plan:
    models: list[str]
    engines: list[str]
    workloads: list[str]
    repeats: int
    radix_extra: bool
    skipped: dict[str, str] = field(default_factory=dict)


def ensure_model(preset: str, model_dir: Path) -> Path:
    from tandem.tools.make_tiny_model import make_tiny_model

    path = model_dir / f"llama-{preset}"
    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        print(f"[compare] building the {preset} model in {path}", flush=True)
        make_tiny_model(path, arch="llama", preset=preset)
    return path


def _emit(row: dict[str, Any], rows: list[dict[str, Any]], jsonl: Path) -> None:
    rows.append(row)
    with open(jsonl, "a") as f:
        f.write(json.dumps(row) + "\n")


def _summary(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('error', '')[:200]}"
    return (
        f"out {row['output_throughput']:.1f} tok/s, total {row['total_throughput']:.1f} tok/s, "
        f"TTFT med {row['median_ttft_ms']:.1f} ms, TPOT med {row['median_tpot_ms']:.2f} ms, "
        f"{row['completed']} ok / {row['failed']} failed, {row['duration']:.1f} s"
        + (f", {row['wrong_length']} of another output length" if row.get("wrong_length") else "")
        + (f"; first error: {row['errors'][0][:200]}" if row.get("errors") else "")
    )


def run_engine(
    engine: str,
    model: str,
    dtype: str,
    model_dir: Path,
    workloads: list[Workload],
    plan: Plan,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    run_id: str,
    space: TokenSpace | None = None,
    extra: dict[str, Any] | None = None,
    base_extra: dict[str, Any] | None = None,
) -> None:
    """`model`: the row label (preset and dtype, `model_label`; in GGUF mode the file's format).
    `space`: the prompts' token space (default: the model's); `extra`: fields added to every
    request body; `base_extra`: fields added to every row."""
    space = space if space is not None else load_token_space(str(model_dir))
    base = {
        "run_id": run_id,
        "engine": engine,
        "model": model,
        "dtype": dtype,
        "model_dir": str(model_dir),
        "quick": args.quick,
        "command": args.command,
        "version": engine_version(engine, args),
        **(base_extra or {}),
    }
    runner: Callable[[Workload, int], dict[str, Any]]
    server: Server | None = None
    hf: HFRunner | None = None
    t0 = time.monotonic()
    try:
        if engine == "hf":
            hf = HFRunner(model_dir, dtype)
            hf.warm_up(space)
            runner = lambda w, seed: hf.run(w, space, seed)  # noqa: E731
        else:
            port = free_port()
            cmd, env = server_command(engine, model_dir, port, dtype, args)
            server = Server(engine, cmd, env, args.log_dir / f"{run_id}-{engine}-{model.replace(' ', '-')}.log", port)
            ready = server.wait_ready(START_TIMEOUT[engine] * args.start_timeout_scale)
            print(f"[compare] {engine} on {model}: ready after {ready:.0f} s (log {server.log_path})", flush=True)
            warm_up_server(BACKENDS[engine], server.base_url, space, extra)
            runner = lambda w, seed: run_http_workload(
                BACKENDS[engine],
                server.base_url,
                w,
                space,
                seed,  # noqa
                extra,
            )
        for rep in range(plan.repeats):
            for w in workloads:
                seed = args.seed + 1000 * (ord(w.key) - ord("a")) + rep
                row = {
                    **base,
                    "workload": w.key,
                    "repeat": rep,
                    "seed": seed,
                    "timestamp": time.time(),
                    "loadavg_1m": os.getloadavg()[0],
                    "request_rate": "inf" if math.isinf(w.request_rate) else w.request_rate,
                    "max_concurrency": w.max_concurrency,
                }
                try:
                    row.update(runner(w, seed))
                    row["status"] = "ok" if row["completed"] > 0 else "failed"
                except Exception as e:  # noqa: BLE001 - record it and go on
                    row.update(status="error", error=f"{type(e).__name__}: {e}")
                _emit(row, rows, args.results_jsonl)
                print(
                    f"[compare] {model} {engine:<15} ({w.key}) rep {rep + 1}/{plan.repeats}: {_summary(row)}",
                    flush=True,
                )
    except Exception as e:  # noqa: BLE001 - an engine that cannot start is reported, not fatal
        msg = f"{type(e).__name__}: {e}"
        print(f"[compare] {engine} on {model} FAILED: {msg}", flush=True)
        _emit(
            {**base, "workload": None, "status": "error", "error": msg[:2000], "timestamp": time.time()},
            rows,
            args.results_jsonl,
        )
    finally:
        if server is not None:
            killed = server.stop()
            if killed:
                print(f"[compare] {engine}: pids {killed} needed SIGKILL", flush=True)
        if hf is not None:
            hf.close()
    print(f"[compare] {engine} on {model}: {time.monotonic() - t0:.0f} s in all", flush=True)


def run_matrix(plan: Plan, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    run_id = time.strftime("%Y%m%d-%H%M%S")
    args.results_jsonl.parent.mkdir(parents=True, exist_ok=True)
    args.results_jsonl.write_text("")
    for preset in args.models:
        model_dir = ensure_model(preset, args.model_dir)
        workloads = make_workloads(args.quick, args.rates[preset])
        selected = [workloads[k] for k in plan.workloads]
        for dtype in args.dtypes:
            model = model_label(preset, dtype)
            for engine in plan.engines:
                ws = [w for w in selected if not (engine == "hf" and w.key == "c")]
                if ws:
                    run_engine(engine, model, dtype, model_dir, ws, plan, args, rows, run_id)
                if engine == "tandem" and plan.radix_extra:
                    run_engine(NORADIX, model, dtype, model_dir, [workloads["d"]], plan, args, rows, run_id)
    return rows


# ---- aggregation and the report -----------------------------------------------------
def _agg(values: list[float]) -> tuple[float, float, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(model, engine, workload) -> {metric: (median, min, max), "n": repeats, "errors": [...]}."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("workload"):
            groups.setdefault((r["model"], r["engine"], r["workload"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        entry: dict[str, Any] = {
            "n": len(ok),
            "runs": len(rs),
            "errors": sorted(
                {e for r in rs for e in (r.get("errors") or [])} | {r["error"] for r in rs if r.get("error")}
            ),
        }
        if ok:
            for metric in ok[0]:
                if isinstance(ok[0][metric], (int, float)) and not isinstance(ok[0][metric], bool):
                    entry[metric] = _agg([r.get(metric) for r in ok])
            entry["failed_requests"] = sum(r.get("failed", 0) for r in ok)
        out[key] = entry
    return out


def _fmt(v: tuple[float, float, float] | None, digits: int = 1) -> str:
    if v is None:
        return "-"
    med, lo, hi = v
    if lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


COLUMNS = {  # workload -> [(header, metric, digits)]
    "a": [
        ("output tok/s", "output_throughput", 0),
        ("total tok/s", "total_throughput", 0),
        ("req/s", "request_throughput", 2),
        ("median TTFT ms", "median_ttft_ms", 0),
        ("median TPOT ms", "median_tpot_ms", 1),
        ("median E2E s", "median_e2e_latency_ms", 0),
    ],
    "b": [
        ("output tok/s", "output_throughput", 0),
        ("median TTFT ms", "median_ttft_ms", 1),
        ("median TPOT ms", "median_tpot_ms", 2),
        ("median E2E ms", "median_e2e_latency_ms", 0),
    ],
    "c": [
        ("req/s", "request_throughput", 2),
        ("median TTFT ms", "median_ttft_ms", 1),
        ("p99 TTFT ms", "p99_ttft_ms", 1),
        ("median TPOT ms", "median_tpot_ms", 2),
        ("p99 TPOT ms", "p99_tpot_ms", 2),
        ("p99 ITL ms", "p99_itl_ms", 1),
    ],
    "d": [
        ("output tok/s", "output_throughput", 0),
        ("total tok/s", "total_throughput", 0),
        ("median TTFT ms", "median_ttft_ms", 0),
        ("p99 TTFT ms", "p99_ttft_ms", 0),
        ("cached prompt tokens", "total_cached_tokens", 0),
        ("wall s", "duration", 2),
    ],
}
COLUMNS["e"] = COLUMNS["a"]


def _engine_order(agg: dict, model: str, workload: str) -> list[str]:
    order = ["tandem", NORADIX, "vllm", "sglang", "hf"]
    return [e for e in order if (model, e, workload) in agg]


def best_peer_ratio(
    agg: dict, model: str, metric: str = "output_throughput", workload: str = "a"
) -> tuple[float, float, str, float] | None:
    """(Tandem median, best peer median, peer, ratio) for `metric` on `workload`."""
    tandem = agg.get((model, "tandem", workload), {}).get(metric)
    peers = [
        (agg[(model, e, workload)][metric][0], e)
        for e in ("vllm", "sglang", "hf")
        if agg.get((model, e, workload), {}).get(metric)
    ]
    if not tandem or not peers:
        return None
    best, name = max(peers)
    return tandem[0], best, name, tandem[0] / best if best else math.inf


def render_tables(agg: dict, models: list[str], workloads: dict[str, Workload], rates: dict[str, float]) -> str:
    lines = []
    ratios = [
        (m, k, best_peer_ratio(agg, m, workload=k)) for m in models for k in THROUGHPUT_WORKLOADS if k in workloads
    ]
    if any(r for _, _, r in ratios):
        lines += [
            "### Tandem / best peer, output throughput",
            "",
            "| model | workload | Tandem output tok/s | best peer | peer output tok/s | Tandem / best peer |",
            "|---|---|---|---|---|---|",
        ]
        for m, k, r in ratios:
            if r:
                lines.append(f"| {m} | ({k}) | {r[0]:.0f} | {ENGINE_LABELS[r[2]]} | {r[1]:.0f} | **{r[3]:.2f}x** |")
        lines.append("")
    for m in models:
        for key, w in workloads.items():
            engines = _engine_order(agg, m, key)
            if not engines:
                continue
            cols = COLUMNS[key]
            rate = f", {rates[preset_of(m)]:g} req/s" if key == "c" else ""
            lines += [f"### {m}, workload ({key}): {w.title}{rate}", ""]
            header = "| engine | " + " | ".join(c[0] for c in cols) + " |"
            if key in THROUGHPUT_WORKLOADS:
                header += " Tandem / best peer |"
            lines += [header, "|" + "---|" * (header.count("|") - 1)]
            ratio = best_peer_ratio(agg, m, workload=key) if key in THROUGHPUT_WORKLOADS else None
            for e in engines:
                entry = agg[(m, e, key)]
                cells = []
                for _, metric, digits in cols:
                    v = entry.get(metric)
                    if metric == "median_e2e_latency_ms" and key in ("a", "e") and v:
                        v = tuple(x / 1000 for x in v)
                        digits = 2
                    cells.append(_fmt(v, digits))
                row = f"| {ENGINE_LABELS[e]} | " + " | ".join(cells) + " |"
                if key in THROUGHPUT_WORKLOADS:
                    row += f" {ratio[3]:.2f}x |" if (ratio and e == "tandem") else " |"
                if entry["n"] < entry["runs"] or entry.get("failed_requests"):
                    failed_runs, failed_requests = entry["runs"] - entry["n"], entry.get("failed_requests", 0)
                    row += f" <!-- {failed_runs} failed runs, {failed_requests} failed requests -->"
                lines.append(row)
            errs = sorted({e for en in engines for e in agg[(m, en, key)]["errors"]})
            if errs:
                lines += ["", "Errors: " + "; ".join(x[:200] for x in errs[:5])]
            lines.append("")
    lines += render_radix(agg, models)
    return "\n".join(lines)


def render_radix(agg: dict, models: list[str]) -> list[str]:
    rows = []
    for m in models:
        on, off = agg.get((m, "tandem", "d")), agg.get((m, NORADIX, "d"))
        if not on or not off or "prompt_tokens_computed" not in on or "prompt_tokens_computed" not in off:
            continue
        c_on, c_off = on["prompt_tokens_computed"][0], off["prompt_tokens_computed"][0]
        t_on, t_off = on["duration"][0], off["duration"][0]
        rows.append(
            f"| {m} | {c_on:.0f} | {c_off:.0f} | {c_on / c_off:.2f} | {_fmt(on['duration'], 2)} | "
            f"{_fmt(off['duration'], 2)} | {t_on / t_off:.2f} |"
        )
    if not rows:
        return []
    return [
        "### Tandem radix cache on workload (d): default vs --disable-radix-cache",
        "",
        "Prompt tokens computed = sum over requests of prompt_tokens - cached_tokens (from `meta_info`).",
        "",
        "| model | prompt tokens computed, radix | without radix | ratio | wall s, radix | wall s, without |"
        " wall ratio |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def render_plot(agg: dict, models: list[str], workloads: dict[str, Workload], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "a" in workloads:
        panels.append(("a", "output_throughput", "(a) 16 concurrent: output tok/s"))
    if "b" in workloads:
        panels.append(("b", "output_throughput", "(b) 1 request: output tok/s"))
    lat_key = "c" if "c" in workloads else ("b" if "b" in workloads else None)
    if lat_key:
        panels.append((lat_key, "latency", f"({lat_key}) median TTFT and TPOT (ms)"))
    if not panels or not models:
        return False
    colors = {"tandem": "#1f77b4", NORADIX: "#aec7e8", "vllm": "#ff7f0e", "sglang": "#2ca02c", "hf": "#7f7f7f"}
    fig, axes = plt.subplots(len(models), len(panels), figsize=(5 * len(panels), 3.8 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, (wk, metric, title) in enumerate(panels):
            ax = axes[i][j]
            engines = [e for e in _engine_order(agg, m, wk) if e != NORADIX]
            if metric == "latency":
                width = 0.38
                for k, (lm, label) in enumerate((("median_ttft_ms", "TTFT"), ("median_tpot_ms", "TPOT"))):
                    vals = [agg[(m, e, wk)].get(lm) for e in engines]
                    xs = [x + (k - 0.5) * width for x in range(len(engines))]
                    meds = [v[0] if v else 0 for v in vals]
                    err = [[v[0] - v[1] if v else 0 for v in vals], [v[2] - v[0] if v else 0 for v in vals]]
                    ax.bar(
                        xs, meds, width, yerr=err, capsize=3, label=label, color=["#d62728", "#9467bd"][k], alpha=0.85
                    )
                ax.set_yscale("log")
                positive = [
                    v[1]
                    for e in engines
                    for lm in ("median_ttft_ms", "median_tpot_ms")
                    if (v := agg[(m, e, wk)].get(lm)) and v[1] > 0
                ]
                if positive:
                    ax.set_ylim(bottom=min(positive) / 3)
                ax.legend(fontsize=8)
            else:
                vals = [agg[(m, e, wk)].get(metric) for e in engines]
                meds = [v[0] if v else 0 for v in vals]
                err = [[v[0] - v[1] if v else 0 for v in vals], [v[2] - v[0] if v else 0 for v in vals]]
                ax.bar(range(len(engines)), meds, yerr=err, capsize=4, color=[colors[e] for e in engines])
                for x, v in enumerate(meds):
                    ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(engines)))
            ax.set_xticklabels([ENGINE_LABELS[e].replace(" transformers", "") for e in engines], fontsize=8)
            ax.set_title(f"{m}: {title}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Median of repeats; bars show min-max", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def command_line(argv: list[str]) -> str:
    return report.command_line("benchmarks/compare.py", argv)


def render_markdown(
    rows: list[dict[str, Any]], args: argparse.Namespace, plan: Plan, versions: dict[str, str], plot_path: Path | None
) -> str:
    agg = aggregate(rows)
    workloads = {
        k: v
        for k, v in make_workloads(args.quick, args.rates[preset_of(plan.models[0])]).items()
        if k in plan.workloads
    }
    smoke = args.quick or plan.repeats < 3
    out = ["# Benchmarks: Tandem, vLLM, SGLang and HF transformers", "", PAGE_INTRO, ""]
    if smoke:
        out += [
            "> **SMOKE RUN** (`--quick`, or fewer than 3 repeats): these numbers only show that the",
            "> comparison runs end to end. Fewer prompts and repeats than the full matrix; do not read",
            "> them as results. Regenerate with the full command below in a quiet period.",
            "",
        ]
    out += [
        f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/compare.py`.",
        "",
        "## Command",
        "",
        "```bash",
        args.command,
        "```",
        "",
        "Full matrix (all engines present, both models, all workloads, 3 repeats):",
        "",
        "```bash",
        "make bench-compare        # = .venv/bin/python benchmarks/compare.py",
        "```",
        "",
        "## Machine",
        "",
    ]
    out += [f"- {line}" for line in machine_info()]
    for e in [*plan.engines, NORADIX]:
        if e in versions:
            out.append(f"- {ENGINE_LABELS[e]}: {versions[e]}")
    for e, why in plan.skipped.items():
        out.append(f"- {ENGINE_LABELS.get(e, e)}: not run ({why})")
    loads = [r["loadavg_1m"] for r in rows if r.get("loadavg_1m") is not None]
    if loads:
        out.append(
            f"- 1-minute load average at the start of each run: {min(loads):.2f} to {max(loads):.2f} "
            f"(median {statistics.median(loads):.2f}; the benchmark itself adds up to ~1; more means "
            "other processes competed for the cores)"
        )
    out += [
        "",
        "## Methodology",
        "",
        "- Models: `python -m tandem.tools.make_tiny_model --arch llama --preset 7m|100m` (seeded random "
        "weights, saved in fp32; 7m = 7.3M parameters, 100m = 102M), one directory loaded by every engine, "
        "in each dtype of the row's label (every engine is given `--dtype float32` or `--dtype bfloat16`; "
        "HF transformers loads with that `dtype`).",
        "- One engine at a time (the 1-minute load average at the start of each run is recorded above): "
        "start its server, wait for `GET /health`, "
        "warm it up (16 concurrent short requests, then one), run every workload `--repeats` times, stop "
        "it (SIGTERM to its process group, SIGKILL to anything left), then the next engine.",
        "- Requests come from `tandem.bench_serving` (its dataset generators, `send_request`, "
        "`run_requests` and `compute_metrics`, called in-process): prompts are token ids, greedy, "
        "`ignore_eos`, streamed; Tandem and SGLang through native `POST /generate`, vLLM through "
        "`POST /v1/completions`. Each run starts with one unmeasured warm-up request of its own.",
        "- HF transformers runs in the benchmark process: `model.generate` on left-padded batches of the "
        "same prompts (batch = the workload's concurrency), greedy, `min_new_tokens = max_new_tokens`; "
        "TTFT and step times come from a streamer. It has no server, so no request-rate workload (c).",
        "- Each repeat uses its own prompt seed (no cross-run prefix-cache hits). Tables show the median "
        "of the repeats with the min-max range in parentheses.",
        "- Metrics (SGLang's definitions, `tandem/benchmarks/metrics.py`): output tok/s = generated tokens "
        "/ run duration (first send to last response); total tok/s adds prompt tokens; TTFT = first token "
        "- send; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between streamed tokens.",
        "- vLLM and SGLang are installed outside this repository and started by the peers' serve script "
        "(`--peers-serve`). vLLM: `serve.sh vllm DIR PORT --dtype D --enable-prompt-tokens-details` ("
        "max-model-len 2048; the flag only makes it report cached prompt tokens)"
        + (
            ", with `VLLM_CPU_OMP_THREADS_BIND=0-N VLLM_CPU_NUM_OF_RESERVED_CPU=0` so it computes on all cores"
            if args.vllm_all_cores
            else ", vLLM's default CPU thread binding"
        )
        + ". SGLang: "
        "`serve.sh sglang DIR PORT --dtype D` (CPU, torch-native, `--max-total-tokens 65536`). Tandem: "
        "`python -m tandem.launch_server --model-path DIR --port P --dtype D`, other flags at their defaults.",
        "",
        "### Workloads",
        "",
        "| key | workload | bench_serving flags of the same prompts |",
        "|---|---|---|",
    ]
    for key, w in workloads.items():
        rates = ""
        if key == "c":
            presets = dict.fromkeys(preset_of(m) for m in plan.models)
            rates = " Rate per model: " + ", ".join(f"{m} {args.rates[m]:g} req/s" for m in presets) + "."
        out.append(f"| {key} | {w.title}.{rates} | `{w.bench_serving_flags()}` |")
    out += [
        "",
        "Output lengths are fixed at the value shown (bench_serving's `--random-range-ratio` would also "
        "shorten outputs; this script applies it to prompts only).",
        "",
        "## Results",
        "",
    ]
    if plot_path is not None:
        out += [f"![throughput and latency per engine]({plot_path.name})", ""]
    out.append(render_tables(agg, plan.models, workloads, args.rates))
    failed = [r for r in rows if r.get("workload") is None and r.get("status") == "error"]
    if failed:
        out += ["### Engines that did not run", ""]
        out += [
            f"- {ENGINE_LABELS.get(r['engine'], r['engine'])} on {r['model']}: {r['error'].splitlines()[0][:300]}"
            for r in failed
        ]
        out.append("")
    if args.notes and Path(args.notes).exists():
        out += ["## Reading", "", Path(args.notes).read_text().strip(), ""]
    return "\n".join(out)


# The first paragraph of docs/benchmarks.md (main mode writes it; a GGUF run keeps it).
PAGE_INTRO = (
    "Everything on this page is generated, each part from one run that names its date, machine and "
    "commit: by `benchmarks/compare.py` the side-by-side run with vLLM, SGLang and HF transformers "
    '(`make bench-compare`) and the GGUF section (`make bench-compare BENCH_ARGS="--gguf"`); by '
    "`benchmarks/moe_decode.py`, `benchmarks/lora.py` and `benchmarks/speculative.py` (each with "
    "`--doc docs/benchmarks.md`) the sections of MoE decoding (#25), multi-LoRA serving (#27) and "
    "speculative decoding (#28). Each run rewrites its own section alone; a full compare.py run rewrites "
    "the page and keeps the others. Rerun them rather than editing the page. Readings of runs, partial "
    "runs and the measurements behind the code's choices are in [perf-log/](perf-log/README.md)."
)


def write_main_doc(doc: Path, page: str) -> str:
    """Write the main run's `page` to `doc`, keeping every generated section `doc` holds (the
    GGUF one, those of moe_decode.py, lora.py, speculative.py; after the page); return what it did."""
    return report.rewrite_page(doc, page)


def print_console(rows: list[dict[str, Any]], plan: Plan) -> None:
    agg = aggregate(rows)
    for m in plan.models:
        for k in THROUGHPUT_WORKLOADS:
            r = best_peer_ratio(agg, m, workload=k)
            if r:
                print(
                    f"[compare] {m} ({k}) output tok/s: Tandem {r[0]:.0f}, best peer {ENGINE_LABELS[r[2]]} "
                    f"{r[1]:.0f}, Tandem / best peer = {r[3]:.2f}x",
                    flush=True,
                )


# ---- GGUF mode: Tandem and llama.cpp on the same GGUF files ---------------------------
LLAMA_BENCH = "llama-bench"  # llama.cpp's raw prefill / decode speed (no server)
GGUF_ENGINES = ("tandem", DEQUANT, LLAMACPP, LLAMA_BENCH)
ENGINE_LABELS[LLAMA_BENCH] = "llama.cpp llama-bench"
# --gguf-formats value -> llama-quantize's type name (also the file's label in the tables)
GGUF_FORMATS = {
    "q4_1": "Q4_1",
    "q4_0": "Q4_0",
    "q8_0": "Q8_0",
    "q4_k_m": "Q4_K_M",
    "bf16": "BF16",
    "q5_0": "Q5_0",
    "q5_1": "Q5_1",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
    "f16": "F16",
    "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS",
}
DEFAULT_GGUF_FORMATS = ["q4_1", "q4_0", "q8_0", "q4_k_m", "bf16"]
DEFAULT_GGUF_WORKLOADS = ["a", "b", "e"]
DEFAULT_GGUF_SOURCE = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_GOAL_FORMATS = ("Q4_1", "Q4_0", "Q8_0", "Q4_K_M")  # the files issue #23's targets name
GGUF_BENCH_LEN = 128  # llama-bench -p / -n
LLAMA_SERVER_SLOTS, LLAMA_SERVER_CTX = 64, 65536  # -np / -c: 1024 tokens per slot
GGUF_SCRIPT = "benchmarks/compare.py --gguf"
GGUF_DOC_BEGIN, GGUF_DOC_END = report.section_markers(GGUF_SCRIPT)


def _gguf_int(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return int(field.parts[field.data[0]][0])


def gguf_file_info(path: Path) -> dict[str, Any]:
    """Format (from `general.file_type`), size, tensor type counts and end-of-generation ids."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    ftype = _gguf_int(reader, "general.file_type")
    try:
        fmt = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_") if ftype is not None else "?"
    except ValueError:
        fmt = f"file_type {ftype}"
    types: dict[str, int] = {}
    for t in reader.tensors:
        name = gguf.GGMLQuantizationType(t.tensor_type).name
        types[name] = types.get(name, 0) + 1
    eos = [
        i
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (i := _gguf_int(reader, key)) is not None
    ]
    params = sum(int(t.n_elements) for t in reader.tensors)
    return {
        "format": fmt,
        "size_mib": path.stat().st_size / 2**20,
        "types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
        "eos_ids": sorted(set(eos)),
        "params": params,
    }


def _gguf_stem(src: Path, fmt: str) -> str:
    name = src.name.removesuffix(".gguf")
    return name[: -len(fmt) - 1] if name.lower().endswith("." + fmt.lower()) else name


def prepare_gguf_files(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The source file and, made once from it with llama-quantize (cached in --gguf-dir), the
    other --gguf-formats; one info dict per format (`gguf_file_info` + label, path, made_by)."""
    src = args.gguf_source
    if not src.is_file():
        raise SystemExit(f"--gguf-source: {src} not found (`make install` fetches the default model)")
    src_info = gguf_file_info(src)
    stem = _gguf_stem(src, src_info["format"])
    quantize = args.llamacpp_bin / "llama-quantize"
    files = []
    for fmt in args.gguf_formats:
        label = GGUF_FORMATS[fmt]
        if label == src_info["format"]:
            files.append({**src_info, "label": label, "path": str(src), "made_by": "source"})
            continue
        path = args.gguf_dir / f"{stem}.{label}.gguf"
        made_by = f"llama-quantize --allow-requantize {src.name} {path.name} {label}"
        if not (path.is_file() and path.stat().st_mtime >= src.stat().st_mtime):
            if not quantize.exists():
                build_llama_quantize(args)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            log = args.log_dir / f"quantize-{label}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[compare] making {path} ({made_by}; log {log})", flush=True)
            with open(log, "w") as f:
                res = subprocess.run(
                    [str(quantize), "--allow-requantize", str(src), str(tmp), label, str(args.threads)],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=1800,
                )
            if res.returncode != 0 or not tmp.is_file():
                tmp.unlink(missing_ok=True)
                raise SystemExit(f"llama-quantize to {label} failed (exit {res.returncode}); see {log}")
            os.replace(tmp, path)
        info = gguf_file_info(path)
        files.append({**info, "label": label, "path": str(path), "made_by": made_by})
    return files


def build_llama_quantize(args: argparse.Namespace) -> None:
    """../shared/peers/setup.sh llamacpp builds llama-server and llama-bench; llama-quantize is one
    more target of the same build directory (about a minute: the libraries are built)."""
    build = args.llamacpp_bin.parent
    if not (build / "CMakeCache.txt").is_file():
        raise SystemExit(
            f"{args.llamacpp_bin / 'llama-quantize'} not found and {build} is no llama.cpp build "
            "directory: run ../shared/peers/setup.sh llamacpp first"
        )
    log = args.log_dir / "build-llama-quantize.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[compare] building llama-quantize in {build} (log {log})", flush=True)
    with open(log, "w") as f:
        res = subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-quantize", f"-j{args.threads}"],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=3600,
        )
    if res.returncode != 0 or not (args.llamacpp_bin / "llama-quantize").exists():
        raise SystemExit(f"building llama-quantize failed (exit {res.returncode}); see {log}")


def llama_server_command(path: Path, port: int, args: argparse.Namespace) -> list[str]:
    t = str(args.threads)
    return [
        str(args.llamacpp_bin / "llama-server"),
        "-m",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-a",
        "m",
        "-t",
        t,
        "-tb",
        t,
        "-np",
        str(LLAMA_SERVER_SLOTS),
        "-c",
        str(LLAMA_SERVER_CTX),
    ]


def llama_bench_command(path: str, args: argparse.Namespace) -> list[str]:
    return [
        str(args.llamacpp_bin / "llama-bench"),
        "-m",
        path,
        "-t",
        str(args.threads),
        "-p",
        str(GGUF_BENCH_LEN),
        "-n",
        str(GGUF_BENCH_LEN),
        "-r",
        str(args.repeats),
        "-o",
        "json",
    ]


_LLAMACPP_VERSION: dict[str, str] = {}


def llamacpp_version(args: argparse.Namespace) -> str:
    """`llama-server --version`, where its sources came from and the SIMD options it was built with."""
    key = str(args.llamacpp_bin)
    if key in _LLAMACPP_VERSION:
        return _LLAMACPP_VERSION[key]
    parts = []
    try:
        res = subprocess.run(
            [str(args.llamacpp_bin / "llama-server"), "--version"], capture_output=True, text=True, timeout=30
        )
        first = next((ln.strip() for ln in (res.stdout + res.stderr).splitlines() if ln.strip()), "")
        parts.append("llama-server " + first.removeprefix("version: ") if first else "llama-server")
    except (OSError, subprocess.TimeoutExpired):
        parts.append("llama-server (version unknown)")
    sdists = sorted((args.peers_dir / "dl").glob("llama_cpp_python-*.tar.gz"))
    if sdists:
        parts.append("sources vendored by " + sdists[-1].name.removesuffix(".tar.gz").replace("_", "-", 2))
    cache = args.llamacpp_bin.parent / "CMakeCache.txt"
    if cache.is_file():
        on = [
            line.split(":", 1)[0].removeprefix("GGML_")
            for line in cache.read_text(errors="replace").splitlines()
            if line.startswith(("GGML_AVX", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AMX", "GGML_NATIVE"))
            and line.endswith("=ON")
        ]
        parts.append("built with " + (", ".join(on) or "no SIMD option") + " ON")
    _LLAMACPP_VERSION[key] = "; ".join(parts)
    return _LLAMACPP_VERSION[key]


def gguf_engine_available(engine: str, args: argparse.Namespace) -> str | None:
    binary = {LLAMACPP: "llama-server", LLAMA_BENCH: "llama-bench"}.get(engine)
    if binary and not (args.llamacpp_bin / binary).exists():
        return f"{args.llamacpp_bin / binary} not found (build it with ../shared/peers/setup.sh llamacpp)"
    return None


def run_llama_bench(
    info: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]], base: dict[str, Any]
) -> None:
    cmd = llama_bench_command(info["path"], args)
    row = {
        **base,
        "engine": LLAMA_BENCH,
        "kind": LLAMA_BENCH,
        "workload": None,
        "timestamp": time.time(),
        "loadavg_1m": os.getloadavg()[0],
        "bench_command": " ".join(cmd),
        "version": llamacpp_version(args),
    }
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"exit {res.returncode}: {res.stderr.strip()[-500:]}")
        for entry in json.loads(res.stdout):
            key = "tg" if entry.get("n_gen") else "pp"
            row[f"{key}_tok_s"] = float(entry["avg_ts"])
            row[f"{key}_stddev"] = float(entry.get("stddev_ts") or 0.0)
        row["status"] = "ok" if "pp_tok_s" in row and "tg_tok_s" in row else "failed"
        print(
            f"[compare] {info['label']} llama-bench: prompt {row.get('pp_tok_s', 0):.0f} tok/s, "
            f"generation {row.get('tg_tok_s', 0):.1f} tok/s",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - record it and go on
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
        print(f"[compare] {info['label']} llama-bench FAILED: {row['error'][:300]}", flush=True)
    _emit(row, rows, args.results_jsonl)


def run_gguf(plan: Plan, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per file: llama-bench, then each server one after another on that file."""
    rows: list[dict[str, Any]] = []
    run_id = time.strftime("%Y%m%d-%H%M%S")
    args.results_jsonl.parent.mkdir(parents=True, exist_ok=True)
    args.results_jsonl.write_text("")
    files = prepare_gguf_files(args)
    for f in files:
        _emit(
            {
                "run_id": run_id,
                "kind": "gguf-file",
                "engine": None,
                "workload": None,
                "status": "ok",
                "quick": args.quick,
                "command": args.command,
                "timestamp": time.time(),
                **f,
            },
            rows,
            args.results_jsonl,
        )
        types = ", ".join(f"{t} {n}" for t, n in f["types"].items())
        print(f"[compare] {f['label']}: {f['path']} ({f['size_mib']:.1f} MiB; {types})", flush=True)
    # The same prompts for every file and engine: the source's token space.
    space = load_token_space(str(args.gguf_source))
    workloads = make_workloads(args.quick, 1.0)
    selected = [workloads[k] for k in plan.workloads]
    for f in files:
        base = {
            "run_id": run_id,
            "mode": "gguf",
            "format": f["label"],
            "file": f["path"],
            "quick": args.quick,
            "command": args.command,
        }
        if LLAMA_BENCH in plan.engines:
            run_llama_bench(f, args, rows, {**base, "model": f["label"]})
        for engine in plan.engines:
            if engine == LLAMA_BENCH or (engine == DEQUANT and f["label"] not in args.gguf_dequant):
                continue
            extra = None
            if engine == LLAMACPP:  # ignore_eos is sent too; the bias is what ../shared/peers/README.md names
                extra = {"logit_bias": {str(i): -100 for i in f["eos_ids"]}}
            run_engine(
                engine,
                f["label"],
                "auto",
                Path(f["path"]),
                selected,
                plan,
                args,
                rows,
                run_id,
                space=space,
                extra=extra,
                base_extra={"mode": "gguf", "format": f["label"], "file": f["path"]},
            )
    return rows


def _med(agg: dict, label: str, engine: str, workload: str, metric: str = "output_throughput") -> float | None:
    v = agg.get((label, engine, workload), {}).get(metric)
    return v[0] if v else None


def _bf16_reference(agg: dict, labels: list[str], workload: str) -> tuple[float, str] | None:
    """Tandem's best output tok/s with bf16 weights on `workload`: the BF16 file with default
    flags, or any file dequantized (--linear-backend torch)."""
    cands = [(v, f"{l} file, --linear-backend torch") for l in labels if (v := _med(agg, l, DEQUANT, workload))]
    if (v := _med(agg, "BF16", "tandem", workload)) is not None:
        cands.append((v, "BF16 file"))
    return max(cands) if cands else None


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def render_gguf(rows: list[dict[str, Any]], args: argparse.Namespace, plan: Plan) -> str:
    """The GGUF section of docs/benchmarks.md (between GGUF_DOC_BEGIN and GGUF_DOC_END)."""
    agg = aggregate(rows)
    files = [r for r in rows if r.get("kind") == "gguf-file"]
    benches = {r["format"]: r for r in rows if r.get("kind") == LLAMA_BENCH}
    labels = [f["label"] for f in files]
    all_workloads = make_workloads(args.quick, 1.0)
    workloads = {k: all_workloads[k] for k in "baecd" if k in plan.workloads}  # one stream first
    stamps = [r["timestamp"] for r in rows if r.get("timestamp")]
    smoke = args.quick or plan.repeats < 3
    rev = next(
        (r["version"] for r in rows if r.get("engine") == "tandem" and r.get("version")),
        "this checkout (" + git_rev(REPO) + ")",
    )
    rev = rev[rev.find("(") + 1 : rev.rfind(")")] if "(" in rev else rev
    out = [GGUF_DOC_BEGIN, "## GGUF side by side: Tandem and llama.cpp on the same files (#23)", ""]
    if smoke:
        out += [
            "> **SMOKE RUN** (`--quick`, or fewer than 3 repeats): fewer prompts and repeats than the full run;",
            "> these numbers only show that every engine runs and is parsed. Do not read them as results.",
            "",
        ]
    when = f"{_utc(min(stamps))}-{time.strftime('%H:%M', time.gmtime(max(stamps)))} UTC" if stamps else "?"
    out += [
        f"Measured {when} by `benchmarks/compare.py --gguf`; Tandem at commit {rev}.",
        "",
        "```bash",
        args.command,
        '# = make bench-compare BENCH_ARGS="--gguf" for the full run (3 repeats; this section is rewritten)',
        "```",
        "",
        "Machine:",
        "",
    ]
    out += [f"- {line}" for line in machine_info()]
    versions = {}
    for r in rows:
        if r.get("engine") in (LLAMACPP, LLAMA_BENCH) and r.get("version"):
            versions.setdefault("llama.cpp", r["version"])
    for name, v in versions.items():
        out.append(f"- {name}: {v}")
    for e, why in plan.skipped.items():
        out.append(f"- {ENGINE_LABELS.get(e, e)}: not run ({why})")
    loads = [r["loadavg_1m"] for r in rows if r.get("loadavg_1m") is not None]
    if loads:
        out.append(
            f"- 1-minute load average at the start of each run: {min(loads):.2f} to {max(loads):.2f} "
            f"(median {statistics.median(loads):.2f}; the benchmark itself adds up to ~1)"
        )
    out += ["", "### Files", "", "| file | made by | MiB | tensor types |", "|---|---|---|---|"]
    for f in files:
        types = ", ".join(f"{t} {n}" for t, n in f["types"].items())
        made = "the source file" if f["made_by"] == "source" else f"`{f['made_by']}`"
        out.append(f"| {f['label']} `{Path(f['path']).name}` | {made} | {f['size_mib']:.1f} | {types} |")
    notes = []
    if any(f["made_by"] != "source" for f in files):
        notes.append(
            f"The other files are made once from `{args.gguf_source.name}` with llama-quantize (cached in "
            f"`{_shown(args.gguf_dir)}`, not committed). llama-quantize dequantizes the source's blocks to float32 "
            "and quantizes those values again: Q4_0 and Q4_K_M are *requantized* from the 4-bit Q4_1 values "
            "(their error adds to Q4_1's), while Q8_0 and BF16 hold the Q4_1 values almost exactly. The files "
            "measure speed on the same model, not the quality of each format."
        )
    if any(f["label"].endswith(("_K_M", "_K_S", "_K")) for f in files):
        notes.append(
            "K-quant blocks span 256 values: llama-quantize gives rows whose length is not a multiple "
            "of 256 another type (a fallback it reports), so the tensor types column says what a K file "
            "actually holds."
        )
    for note in notes:
        out += ["", note]
    out += [
        "",
        "### Method",
        "",
        f"- For each file one engine after another: llama-bench, then Tandem, then llama-server (and Tandem "
        f"`--linear-backend torch` on {', '.join(args.gguf_dequant) or 'no file'}). Each server is started, "
        "waited for (`GET /health`), warmed up (16 concurrent short requests, then one), run through every "
        "workload `--repeats` times and stopped before the next starts.",
        "- Tandem: `python -m tandem.launch_server --model-path FILE --port P --log-level warning`, every "
        "other flag at its default (dtype auto: bfloat16 activations where the CPU multiplies bfloat16 natively, "
        "AVX-512 BF16 or AMX, float32 otherwise; quantized kernels for the types it has).",
        "- Tandem's bf16 rows: the BF16 file with default flags (the weights in the activations' dtype, oneDNN), "
        "and `--linear-backend torch` on a quantized file (dequantized at load to that dtype, `F.linear`).",
        "- llama.cpp: `"
        + " ".join(["llama-server", *llama_server_command(Path("FILE"), 0, args)[1:]]).replace("--port 0", "--port P")
        + "`; raw speed `"
        + " ".join(["llama-bench", *llama_bench_command("FILE", args)[1:]])
        + "`.",
        "- Requests (`tandem.bench_serving`, in-process): token-id prompts, the same ones for every engine and "
        "file (seeded, from the source file's vocabulary), greedy, streamed, fixed output length: Tandem's "
        "native `POST /generate` with `ignore_eos`; llama-server's `POST /v1/completions` with `ignore_eos` "
        "and `logit_bias` -100 on the end-of-generation ids. Output tokens are counted from the server "
        "(`meta_info` / `usage`); the last column of the detailed table says how many requests returned "
        "another length than asked (0 expected).",
        "- Medians of the repeats, min-max in parentheses. Output tok/s = generated tokens / run duration; "
        "TTFT = first streamed token - send; TPOT = (E2E - TTFT) / (output tokens - 1).",
        "",
        "| key | workload | bench_serving flags of the same prompts |",
        "|---|---|---|",
    ]
    for key, w in workloads.items():
        out.append(f"| {key} | {w.title} | `{w.bench_serving_flags()}` |")
    # ---- the ratios
    single, many = "b" in workloads, [k for k in ("a", "e") if k in workloads]
    if any((l, LLAMACPP, k) in agg and (l, "tandem", k) in agg for l in labels for k in workloads):
        head = ["file"]
        if single:
            head += ["(b) 1 stream tok/s, Tandem / llama.cpp", "ratio", "(b) median TTFT ms, Tandem / llama.cpp"]
        for k in many:
            head += [
                f"({k}) {workloads[k].max_concurrency} concurrent tok/s, Tandem / llama.cpp",
                "ratio",
                "Tandem / Tandem bf16",
            ]
        head.append("#23 targets")
        out += [
            "",
            "### Tandem / llama.cpp on the same file",
            "",
            "Targets of #23 (Q4_1, Q4_0, Q8_0, Q4_K_M): one stream at least 1.2x llama.cpp with a median TTFT no "
            "worse; 16 and 64 concurrent at least 2x llama.cpp and no worse than Tandem's best bf16 row "
            "(below).",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for l in labels:
            cells, missed, checked = [l], [], False
            if single:
                t, c = _med(agg, l, "tandem", "b"), _med(agg, l, LLAMACPP, "b")
                tt, ct = _med(agg, l, "tandem", "b", "median_ttft_ms"), _med(agg, l, LLAMACPP, "b", "median_ttft_ms")
                cells += [_pair(t, c, 1), _ratio(t, c), _pair(tt, ct, 1)]
                if t and c:
                    checked = True
                    if t < 1.2 * c:
                        missed.append("1 stream < 1.2x")
                    if tt is not None and ct is not None and tt > ct:
                        missed.append("TTFT")
            for k in many:
                t, c = _med(agg, l, "tandem", k), _med(agg, l, LLAMACPP, k)
                ref = _bf16_reference(agg, labels, k)
                cells += [_pair(t, c, 0), _ratio(t, c), _ratio(t, ref[0], bold=False) if ref else "-"]
                if t and c:
                    checked = True
                    if t < 2 * c:
                        missed.append(f"{workloads[k].max_concurrency} concurrent < 2x")
                    if ref and t < ref[0]:
                        missed.append(f"{workloads[k].max_concurrency} concurrent < bf16")
            goal = (
                "-"
                if l not in GGUF_GOAL_FORMATS or not checked
                else ("met" if not missed else "not met: " + ", ".join(missed))
            )
            bad = sum(
                r.get("wrong_length", 0) + r.get("failed", 0)
                for r in rows
                if r.get("format") == l and r.get("engine") in ("tandem", LLAMACPP) and r.get("workload")
            )
            if bad:
                goal += f" ({bad} request(s) failed or of another length: not comparable)"
            cells.append(goal)
            out.append("| " + " | ".join(cells) + " |")
        refs = [(k, r) for k in many if (r := _bf16_reference(agg, labels, k))]
        if refs:
            out += [
                "",
                "Tandem bf16 reference: " + "; ".join(f"({k}) {r[0]:.0f} tok/s ({r[1]})" for k, r in refs) + ".",
            ]
    # ---- every engine
    if any(key[0] in labels for key in agg):
        head = ["file", "engine"]
        for k in workloads:
            head += [f"({k}) output tok/s", f"({k}) median TTFT ms", f"({k}) median TPOT ms"]
        head.append("requests: ok / failed / other length")
        out += ["", "### Every engine and file", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for l in labels:
            for e in ("tandem", DEQUANT, LLAMACPP):
                entries = [agg[(l, e, k)] for k in workloads if (l, e, k) in agg]
                if not entries:
                    continue
                cells = [l, ENGINE_LABELS[e]]
                for k in workloads:
                    entry = agg.get((l, e, k), {})
                    cells += [
                        _fmt(entry.get("output_throughput"), 1 if k == "b" else 0),
                        _fmt(entry.get("median_ttft_ms"), 1 if k == "b" else 0),
                        _fmt(entry.get("median_tpot_ms"), 2),
                    ]
                ok = [r for r in rows if r.get("format") == l and r.get("engine") == e and r.get("workload")]
                done = sum(r.get("completed", 0) for r in ok)
                failed = sum(r.get("failed", 0) for r in ok) + sum(1 for r in ok if r.get("status") == "error")
                wrong = sum(r.get("wrong_length", 0) for r in ok)
                cells.append(f"{done} / {failed} / {wrong}")
                out.append("| " + " | ".join(cells) + " |")
    # ---- llama-bench
    if benches:
        out += [
            "",
            f"### llama-bench (`-t {args.threads} -p {GGUF_BENCH_LEN} -n {GGUF_BENCH_LEN} "
            f"-r {plan.repeats}`: mean ± standard deviation)",
            "",
            f"| file | prompt {GGUF_BENCH_LEN} tok/s (pp{GGUF_BENCH_LEN}) | generation tok/s (tg{GGUF_BENCH_LEN}) |",
            "|---|---|---|",
        ]
        for l in labels:
            b = benches.get(l)
            if b is None:
                continue
            if b.get("status") != "ok":
                out.append(f"| {l} | {b.get('status')}: {b.get('error', '')[:150]} | |")
                continue
            out.append(
                f"| {l} | {b['pp_tok_s']:.0f} ± {b['pp_stddev']:.0f} | {b['tg_tok_s']:.1f} ± {b['tg_stddev']:.1f} |"
            )
    errors = [
        f"- {ENGINE_LABELS.get(r.get('engine'), r.get('engine'))} on {r.get('model')}"
        + (f" ({r['workload']})" if r.get("workload") else "")
        + f": {r['error'].splitlines()[0][:300]}"
        for r in rows
        if r.get("status") == "error" and r.get("error") and r.get("kind") != LLAMA_BENCH
    ]
    errors += [
        f"- {ENGINE_LABELS.get(e, e)} on {m} ({k}): {err[:300]}"
        for (m, e, k), entry in agg.items()
        for err in entry.get("errors", [])[:2]
        if entry.get("failed_requests")
    ]
    if errors:
        out += ["", "### Errors", "", *dict.fromkeys(errors)]
    out += ["", GGUF_DOC_END]
    return "\n".join(out) + "\n"


def _shown(path: Path) -> str:
    """`path` relative to the repository when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _pair(a: float | None, b: float | None, digits: int) -> str:
    return f"{a:.{digits}f} / {b:.{digits}f}" if a is not None and b is not None else "-"


def _ratio(a: float | None, b: float | None, bold: bool = True) -> str:
    if not a or not b:
        return "-"
    return f"**{a / b:.2f}x**" if bold else f"{a / b:.2f}x"


def splice_doc(doc: Path, section: str) -> str:
    """Replace the generated GGUF section of `doc` (or insert it before the first '## GGUF'
    heading, else at the end); return where it went."""
    return report.splice_section(doc, GGUF_SCRIPT, section, before="## GGUF")


def print_gguf_console(rows: list[dict[str, Any]], plan: Plan) -> None:
    agg = aggregate(rows)
    for l in plan.models:
        for k in plan.workloads:
            t, c = _med(agg, l, "tandem", k), _med(agg, l, LLAMACPP, k)
            if t and c:
                print(
                    f"[compare] {l} ({k}) output tok/s: Tandem {t:.1f}, llama.cpp {c:.1f}, Tandem / llama.cpp = "
                    f"{t / c:.2f}x",
                    flush=True,
                )


def gguf_main(args: argparse.Namespace, argv: list[str]) -> int:
    engines, skipped = [], {}
    for e in args.engines:
        why = gguf_engine_available(e, args)
        if why:
            skipped[e] = why
            print(f"[compare] skipping {e}: {why}", flush=True)
        else:
            engines.append(e)
    plan = Plan(
        models=[GGUF_FORMATS[f] for f in args.gguf_formats],
        engines=engines,
        workloads=[k for k in "abcde" if k in args.workloads],
        repeats=args.repeats,
        radix_extra=False,
        skipped=skipped,
    )
    args.command = command_line(argv)
    t0 = time.monotonic()
    if args.from_jsonl:
        rows = [json.loads(line) for line in args.from_jsonl.read_text().splitlines() if line.strip()]
        if not rows:
            raise SystemExit(f"{args.from_jsonl}: no rows")
        plan.models = [r["label"] for r in rows if r.get("kind") == "gguf-file"]
        present = {r.get("engine") for r in rows}
        plan.engines = [e for e in GGUF_ENGINES if e in present]
        plan.workloads = sorted({r["workload"] for r in rows if r.get("workload")})
        plan.repeats = args.repeats = 1 + max((r.get("repeat") or 0) for r in rows)
        plan.skipped = {}
        args.quick = any(r.get("quick") for r in rows)
        args.command = next((r["command"] for r in rows if r.get("command")), args.command)
    elif args.gguf_prepare_only:
        for f in prepare_gguf_files(args):
            print(
                f"[compare] {f['label']}: {f['path']} ({f['size_mib']:.1f} MiB; "
                + ", ".join(f"{t} {n}" for t, n in f["types"].items())
                + ")",
                flush=True,
            )
        return 0
    else:
        warn_if_busy()
        try:
            rows = run_gguf(plan, args)
        finally:
            stop_all_servers()
    section = render_gguf(rows, args, plan)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Benchmarks: GGUF files, Tandem and llama.cpp\n\n" + section)
    print_gguf_console(rows, plan)
    smoke = args.quick or plan.repeats < 3
    doc = args.doc if args.doc is not None else (None if smoke or args.no_doc else REPO / "docs" / "benchmarks.md")
    if doc is not None and not args.no_doc:
        print(f"[compare] {doc}: {splice_doc(doc, section)}", flush=True)
    print(
        f"[compare] wrote {args.out}; raw rows in {args.from_jsonl or args.results_jsonl}; "
        f"{time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return 0


# ---- CLI ---------------------------------------------------------------------------
def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _rates(value: str) -> dict[str, float]:
    """'4' (every model) or '7m=4,100m=1.5'."""
    rates = dict(DEFAULT_RATES)
    for part in _csv(value):
        if "=" in part:
            k, v = part.split("=", 1)
            rates[k.strip()] = float(v)
        else:
            rates = {k: float(part) for k in ("tiny", "7m", "100m")}
    return rates


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/compare.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engines",
        type=_csv,
        default=None,
        help="comma list of tandem,vllm,sglang,hf (default all); with --gguf of "
        f"{','.join(GGUF_ENGINES)} (default all)",
    )
    p.add_argument("--models", type=_csv, default=["7m", "100m"], help="make_tiny_model presets (7m,100m)")
    p.add_argument("--dtypes", type=_csv, default=list(DTYPES), help="comma list of float32,bfloat16")
    p.add_argument(
        "--workloads", type=_csv, default=None, help="comma list of a,b,c,d,e (default all; with --gguf a,b,e)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, fewer prompts")
    p.add_argument(
        "--rate",
        dest="rates",
        type=_rates,
        default=dict(DEFAULT_RATES),
        help="request rate of workload (c): '4' or per model '7m=4,100m=1.5' (default)",
    )
    p.add_argument(
        "--radix-extra",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run Tandem with --disable-radix-cache on workload (d) (default on)",
    )
    p.add_argument(
        "--vllm-all-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let vLLM compute on every core (VLLM_CPU_OMP_THREADS_BIND; default on)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the report (default /tmp/tandem-bench/report.md, with --gguf gguf.md there)",
    )
    p.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="the page a full run rewrites (default docs/benchmarks.md; none for a smoke run): the whole "
        "page but its GGUF section, or with --gguf that section alone",
    )
    p.add_argument("--no-doc", action="store_true", help="write no doc, only --out")
    p.add_argument(
        "--results-jsonl",
        type=Path,
        default=None,
        help="raw rows (default /tmp/tandem-bench/results.jsonl, with --gguf gguf-results.jsonl)",
    )
    p.add_argument(
        "--from-jsonl", type=Path, default=None, help="render --out from saved rows instead of running anything"
    )
    p.add_argument("--notes", default=None, help="markdown file inserted as the 'Reading' section")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tandem-bench-models"))
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/tandem-bench/logs"))
    p.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS_DIR", "/tmp/peers")))
    p.add_argument("--peers-serve", type=Path, default=REPO.parent / "shared" / "peers" / "serve.sh")
    p.add_argument("--start-timeout-scale", type=float, default=1.0)
    g = p.add_argument_group("GGUF mode (--gguf): Tandem and llama.cpp on the same GGUF files")
    g.add_argument(
        "--gguf",
        action="store_true",
        help="instead of the model presets: the GGUF source file and the --gguf-formats made from it, "
        "each served by Tandem and llama-server one after the other, plus llama-bench; workloads "
        "a,b,e by default; a full run rewrites its section of docs/benchmarks.md",
    )
    g.add_argument(
        "--gguf-source",
        type=Path,
        default=DEFAULT_GGUF_SOURCE,
        help="the GGUF file the others are made from (default: the default model)",
    )
    g.add_argument(
        "--gguf-formats",
        type=_csv,
        default=list(DEFAULT_GGUF_FORMATS),
        help=f"comma list of {','.join(GGUF_FORMATS)} (default {','.join(DEFAULT_GGUF_FORMATS)}); the "
        "source's own format is the source file",
    )
    g.add_argument(
        "--gguf-dequant",
        type=_csv,
        default=None,
        help="formats on which Tandem also runs with --linear-backend torch (bf16, dequantized; default: "
        "the source's format)",
    )
    g.add_argument(
        "--gguf-dir",
        type=Path,
        default=REPO / "models" / "gguf-bench",
        help="where the made files are cached (default models/gguf-bench, ignored by git)",
    )
    g.add_argument("--gguf-prepare-only", action="store_true", help="make the files, print them and stop")
    g.add_argument(
        "--llamacpp-bin",
        type=Path,
        default=None,
        help="llama-server, llama-bench and llama-quantize (default $PEERS_DIR/llama.cpp/build/bin)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama.cpp's -t / -tb and llama-quantize's threads (default: nproc)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    name = "gguf" if args.gguf else "report"
    args.out = args.out or Path(f"/tmp/tandem-bench/{name}.md")
    args.results_jsonl = args.results_jsonl or Path(
        "/tmp/tandem-bench/" + ("gguf-results" if args.gguf else "results") + ".jsonl"
    )
    if args.gguf:
        return _gguf_args(p, args)
    args.engines = args.engines or list(ENGINES)
    args.workloads = args.workloads or list("abcde")
    from tandem.tools.make_tiny_model import PRESETS

    _check_choices(p, "--engines", "engine", args.engines, ENGINES)
    _check_choices(p, "--workloads", "workload", args.workloads, "abcde")
    _check_choices(p, "--dtypes", "dtype", args.dtypes, DTYPES)
    _check_choices(p, "--models", "preset", args.models, PRESETS)
    for m in args.models:
        args.rates.setdefault(m, 4.0)
    return args


def _check_choices(p: argparse.ArgumentParser, flag: str, what: str, values, allowed) -> None:
    """Exit through `p.error` naming the first of `values` not in `allowed`."""
    for v in values:
        if v not in allowed or (isinstance(allowed, str) and len(v) != 1):
            p.error(f"{flag}: unknown {what} {v!r} (expected {','.join(allowed)})")


def _gguf_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    args.engines = args.engines or list(GGUF_ENGINES)
    args.workloads = args.workloads or list(DEFAULT_GGUF_WORKLOADS)
    _check_choices(p, "--engines", "engine with --gguf", args.engines, GGUF_ENGINES)
    _check_choices(p, "--workloads", "workload", args.workloads, "abcde")
    _check_choices(p, "--gguf-formats", "format", args.gguf_formats, GGUF_FORMATS)
    args.gguf_source = args.gguf_source.resolve()
    args.llamacpp_bin = args.llamacpp_bin or args.peers_dir / "llama.cpp" / "build" / "bin"
    if args.gguf_dequant is None:
        if args.gguf_source.is_file():
            args.gguf_dequant = [gguf_file_info(args.gguf_source)["format"]]
        else:
            args.gguf_dequant = []
    else:
        for f in args.gguf_dequant:
            if f not in GGUF_FORMATS:
                p.error(f"--gguf-dequant: unknown format {f!r} (expected {','.join(GGUF_FORMATS)})")
        args.gguf_dequant = [GGUF_FORMATS[f] for f in args.gguf_dequant]
    if args.threads < 1:
        p.error("--threads must be at least 1")
    return args


def plan_from_rows(rows: list[dict[str, Any]], plan: Plan, args: argparse.Namespace) -> None:
    """--from-jsonl: take the models, engines, workloads, repeats, rates and command from the rows."""
    if not rows:
        raise SystemExit(f"{args.from_jsonl}: no rows")
    plan.models = list(dict.fromkeys(r["model"] for r in rows))
    present = {r["engine"] for r in rows}
    plan.engines = [e for e in ENGINES if e in present]
    plan.workloads = sorted({r["workload"] for r in rows if r.get("workload")})
    plan.radix_extra = NORADIX in present
    plan.repeats = 1 + max((r.get("repeat") or 0) for r in rows)
    plan.skipped = {}
    args.quick = any(r.get("quick") for r in rows)
    for r in rows:
        if r.get("workload") == "c" and isinstance(r.get("request_rate"), (int, float)):
            args.rates[preset_of(r["model"])] = float(r["request_rate"])
    args.command = next((r["command"] for r in rows if r.get("command")), args.command)


def warn_if_busy(threshold: float = 1.0) -> None:
    """Benchmarks on 2 cores are only meaningful on an idle machine: say so when it is not."""
    load = os.getloadavg()[0]
    if load <= threshold:
        return
    busy = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cpu = p.cpu_percent(interval=None)
            busy.append((cpu, p))
        except psutil.Error:
            pass
    time.sleep(1.0)
    top = []
    for _, p in busy:
        try:
            top.append((p.cpu_percent(interval=None), p.pid, " ".join(p.info["cmdline"] or [p.info["name"]])[:100]))
        except psutil.Error:
            pass
    top = [t for t in sorted(top, reverse=True)[:5] if t[0] > 10]
    print(
        f"[compare] WARNING: 1-minute load average is {load:.2f} on {os.cpu_count()} cores; other processes "
        "will distort the numbers. Busiest now: "
        + ("; ".join(f"{c:.0f}% pid {pid} {cmd}" for c, pid, cmd in top) or "no single process above 10%"),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    if args.gguf:
        return gguf_main(args, argv)
    engines, skipped = [], {}
    for e in args.engines:
        why = engine_available(e, args)
        if why:
            skipped[e] = why
            print(f"[compare] skipping {e}: {why}", flush=True)
        else:
            engines.append(e)
    plan = Plan(
        models=[model_label(m, d) for m in args.models for d in args.dtypes],
        engines=engines,
        workloads=[k for k in "abcde" if k in args.workloads],
        repeats=args.repeats,
        radix_extra=args.radix_extra and "tandem" in engines and "d" in args.workloads,
        skipped=skipped,
    )
    args.command = command_line(argv)
    t0 = time.monotonic()
    if args.from_jsonl:
        rows = [json.loads(line) for line in args.from_jsonl.read_text().splitlines() if line.strip()]
        plan_from_rows(rows, plan, args)
    else:
        warn_if_busy()
        try:
            rows = run_matrix(plan, args)
        finally:
            stop_all_servers()
    versions = {}
    for r in rows:
        versions.setdefault(r["engine"], r.get("version") or engine_version(r["engine"], args))
    plot_path = args.out.with_suffix(".png")
    if not render_plot(
        aggregate(rows),
        plan.models,
        {k: v for k, v in make_workloads(args.quick, 1.0).items() if k in plan.workloads},
        plot_path,
    ):
        plot_path = None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    page = render_markdown(rows, args, plan, versions, plot_path)
    args.out.write_text(page)
    print_console(rows, plan)
    smoke = args.quick or plan.repeats < 3
    doc = args.doc if args.doc is not None else (None if smoke else REPO / "docs" / "benchmarks.md")
    if doc is not None and not args.no_doc:
        if plot_path is not None:
            shutil.copyfile(plot_path, doc.with_suffix(".png"))
            page = page.replace(f"]({plot_path.name})", f"]({doc.with_suffix('.png').name})")
        print(f"[compare] {doc}: {write_main_doc(doc, page)}", flush=True)
    print(
        f"[compare] wrote {args.out}"
        + (f" and {plot_path}" if plot_path else "")
        + f"; raw rows in {args.from_jsonl or args.results_jsonl}; {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
