"""The GPU benchmark of `make gpu-check` (benchmarks/gpu_check.sh runs it after the CUDA
tests): decode on random-weight models shaped like Qwen2.5-0.5B and Llama-3.2-1B
(`--load-format dummy`), batch 1/16/64/256, for torch_native (eager), triton (eager) and
triton with CUDA graphs, with transformers' `generate` on the same GPU as the peer.
Each decode step is set against the HBM floor: the model's weight bytes divided by the
copy bandwidth measured on this GPU. Writes results.jsonl and results.md to --out.

    python benchmarks/gpu_check.py --out gpu_check_results [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.bench_one_batch import OneBatchBench  # noqa: E402
from tandem.server_args import ServerArgs  # noqa: E402
from tandem.tools.make_tiny_model import make_tiny_model  # noqa: E402

# Shapes of the public configs (vocabulary and all); the weights are random.
SHAPES = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # A smoke run of this script on any machine: `--models tiny --device cpu`.
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
    ),
}
GPU_MODELS = ["qwen2.5-0.5b", "llama-3.2-1b"]
VARIANTS = [("torch_native", False), ("triton", False), ("triton", True)]  # (backend, CUDA graphs)


def shaped_model(root: Path, arch: str, shape: dict) -> Path:
    """A model directory with a small trained tokenizer and `shape`'s config, no weights."""
    kind = "qwen2" if shape["model_type"] == "qwen2" else "llama"
    out = make_tiny_model(root / arch, arch=kind)
    for f in out.glob("*.safetensors"):
        f.unlink()
    config = json.loads((out / "config.json").read_text())
    config.update(shape, torch_dtype="bfloat16")
    config.pop("rope_parameters", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hbm_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write), best of 5."""
    src = torch.ones(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        tic = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - tic)
    del src, dst
    return 2 * 2**30 / best


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def bench_tandem(
    model_dir: Path, device: str, backend: str, graphs: bool, batch_sizes: list[int], input_len: int, output_len: int
) -> tuple[list[dict], int]:
    args = ServerArgs(
        model_path=str(model_dir),
        device=device,
        dtype="bfloat16",
        load_format="dummy",
        random_seed=0,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        max_running_requests=max(batch_sizes),
        max_total_tokens=max(batch_sizes) * (input_len + output_len),
        chunked_prefill_size=-1,
    )
    args.validate()
    bench = OneBatchBench(args)
    rows = []
    for bs in batch_sizes:
        bench.run_once(bs, input_len, 4)
        r = bench.run_once(bs, input_len, output_len)
        rows.append(
            {
                "batch_size": bs,
                "prefill_s": r.prefill_latency,
                "decode_step_s": r.median_decode_latency,
                "decode_tok_s": r.median_decode_throughput,
                "cuda_graphs": bench.runner.cuda_graph_runner is not None,
            }
        )
    wbytes = weight_bytes(bench.runner.model)
    del bench
    free_memory(device)
    return rows, wbytes


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_transformers(
    model_dir: Path, device: str, batch_sizes: list[int], input_len: int, output_len: int
) -> list[dict]:
    """transformers' generate (greedy, bf16, random weights): decode step from the
    difference between generating output_len tokens and one token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    rows = []

    def timed(ids, n):
        sync(device)
        tic = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        sync(device)
        return time.perf_counter() - tic

    with torch.inference_mode():
        for bs in batch_sizes:
            ids = torch.randint(3, 300, (bs, input_len), device=device)
            timed(ids, 2)
            first = statistics.median(timed(ids, 1) for _ in range(2))
            step = (timed(ids, output_len) - first) / (output_len - 1)
            rows.append({"batch_size": bs, "prefill_s": first, "decode_step_s": step, "decode_tok_s": bs / step})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_results")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--models", nargs="+", default=GPU_MODELS, choices=list(SHAPES))
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = hbm_bandwidth(args.device)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    lines = [
        f"# gpu_check on {gpu}",
        "",
        f"HBM copy bandwidth: {bw / 1e9:.0f} GB/s; input {args.input_len}, "
        f"output {args.output_len} tokens; bf16; random weights.",
        "",
    ]
    records = []
    models_root = tempfile.TemporaryDirectory(prefix="gpu_check_models_")
    for name in args.models:
        model_dir = shaped_model(Path(models_root.name), name, SHAPES[name])
        results, wbytes = {}, 0
        for backend, graphs in VARIANTS:
            label = f"{backend}{' + graphs' if graphs else ''}"
            try:
                results[label], wbytes = bench_tandem(
                    model_dir, args.device, backend, graphs, args.batch_size, args.input_len, args.output_len
                )
            except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
                print(f"{name} {label} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                results[label] = []
            print(f"{name} {label}: {results[label]}", flush=True)
        try:
            results["transformers generate"] = bench_transformers(
                model_dir, args.device, args.batch_size, args.input_len, args.output_len
            )
            free_memory(args.device)
        except Exception as e:  # noqa: BLE001
            print(f"{name} transformers failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            results["transformers generate"] = []
        floor = wbytes / bw if wbytes else float("nan")
        lines += [
            f"## {name} (weights {wbytes / 2**20:.0f} MiB, HBM floor {floor * 1e3:.3f} ms/step)",
            "",
            "| engine | bs | decode step ms | x floor | decode tok/s | prefill s |",
            "|---|---|---|---|---|---|",
        ]
        for label, rows in results.items():
            for r in rows:
                ratio = r["decode_step_s"] / floor
                lines.append(
                    f"| {label} | {r['batch_size']} | {r['decode_step_s'] * 1e3:.3f} | {ratio:.2f} | "
                    f"{r['decode_tok_s']:.0f} | {r['prefill_s']:.4f} |"
                )
                records.append(
                    {"gpu": gpu, "model": name, "engine": label, "hbm_floor_s": floor, "floor_ratio": ratio, **r}
                )
        lines.append("")
        (out / "results.md").write_text("\n".join(lines) + "\n")
    with open(out / "results.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
