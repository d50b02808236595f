"""Server configuration: `ServerArgs` (the CLI flags, SGLang's names) and `PortArgs`.

`ServerArgs` is created once in the main process, resolved (defaults that depend on the
model are filled in later by the scheduler and reported back), and passed by value to
every subprocess. `PortArgs` holds the `ipc://` endpoints of one server, all inside a
private 0700 temporary directory, so two servers on one machine never collide.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
from dataclasses import dataclass, field

import psutil

from tandem.sglang_flags import QUANTIZE_AT_LOAD, add_compat_args, check_compat_flags
from tandem.speculative.args import NGRAM_DEFAULT_MIN_WINDOW, add_speculative_args, resolve_speculative_args
from tandem.utils.ipc_dirs import make_ipc_dir

logger = logging.getLogger(__name__)

LOG_LEVELS = ["debug", "info", "warning", "error"]
ATTENTION_BACKENDS = ["torch_native", "triton"]  # tandem/layers/attention/registry.py
LOAD_BALANCE_METHODS = ["round_robin", "shortest_queue"]
# --schedule-policy (tandem/scheduler/schedule_policy.py); priority scheduling orders within the second.
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
PRIORITY_POLICIES = ("fcfs", "lof")


@dataclass
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    device: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    random_seed: int | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    skip_server_warmup: bool = False
    incremental_streaming_output: bool = False
    max_prefill_tokens: int = 16384
    stream_interval: int = 1
    skip_tokenizer_init: bool = False
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    max_queued_requests: int | None = None
    # SGLang's priority scheduling: requests' `priority` orders the waiting queue (larger
    # first, or smaller with schedule_low_priority_values_first) and preempts running
    # requests less preferred by more than the threshold.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    api_key: str | None = None
    max_request_body_bytes: int = 32 * 1024 * 1024
    chat_template: str | None = None
    linear_backend: str = "auto"
    attention_backend: str | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    enable_mixed_chunk: bool = False
    # None: the device's default (the overlap loop on CUDA, the normal loop on CPU).
    disable_overlap_schedule: bool | None = None
    watchdog_timeout: float = 300.0
    graceful_shutdown_timeout: float = 30.0
    log_level_http: str | None = None
    enable_metrics: bool = False
    log_requests: bool = False
    log_requests_level: int = 2
    constrained_json_disable_any_whitespace: bool = False
    # SGLang's flags kept for compatibility (tandem/sglang_flags.py says what each does).
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    load_balance_method: str = "round_robin"
    tokenizer_worker_num: int = 1
    load_format: str = "auto"
    page_size: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # LoRA adapters (tandem/lora); --lora-paths implies --enable-lora, as in SGLang.
    lora_paths: list[str] | None = None
    enable_lora: bool = False
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loaded_loras: int | None = None
    # Speculative decoding (tandem/speculative/args.py fills the defaults).
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = NGRAM_DEFAULT_MIN_WINDOW
    speculative_ngram_max_match_window_size: int = 12
    enable_dp_attention: bool = False
    is_embedding: bool = False
    reasoning_parser: str | None = None
    enable_custom_logit_processor: bool = False
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_mode: str = "auto"
    enable_torch_compile: bool = False
    torch_compile_max_bs: int | None = None
    disable_custom_all_reduce: bool = False
    enable_p2p_check: bool = False
    base_gpu_id: int = 0
    grammar_backend: str = "xgrammar"
    sampling_backend: str | None = None
    show_time_cost: bool = False
    decode_log_interval: int = 40
    enable_cache_report: bool = False
    allow_auto_truncate: bool = False

    def __post_init__(self) -> None:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.device is None:
            self.device = _default_device()
        # SGLang's defaults: a fresh seed per start, and a chunk size from the device memory.
        if self.random_seed is None:
            self.random_seed = random.randint(0, 1 << 30)
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = default_chunked_prefill_size(self.device)
        if self.attention_backend is None:  # SGLang's default for the device
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch_native"
        if self.lora_paths:  # as SGLang
            self.enable_lora = True
        if self.disable_overlap_schedule is None:
            # On CPU the forward computes on the cores the scheduler's Python would overlap
            # it with (and shares its GIL): the normal loop is faster there (measured in
            # docs/perf-log/scheduling.md, "Overlap on CPU"), as vLLM turns async scheduling off on CPU.
            self.disable_overlap_schedule = self.device == "cpu"
            # As SGLang for NGRAM and draft models: speculation runs the normal loop.
            self.disable_overlap_schedule |= self.speculative_algorithm is not None

    @property
    def local_scheduler_ranks(self) -> int:
        """The scheduler processes on each machine (every replica's ranks on this node)."""
        return self.dp_size * self.tp_size // self.nnodes

    def validate(self) -> None:
        """Raise ValueError for values that can never work, naming the flag; log each
        accepted SGLang flag that has no effect in this build."""
        for note in check_compat_flags(self):
            logger.info(note)
        if self.log_level_http is not None and self.log_level_http not in LOG_LEVELS:
            raise ValueError(f"--log-level-http: unknown level {self.log_level_http!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: unsupported value {self.dtype!r}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static: must be in (0, 1)")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval: must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens: must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size: must be positive, or -1 to disable")
        if self.linear_backend not in ("auto", "torch"):
            raise ValueError(f"--linear-backend: unknown backend {self.linear_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend: unknown backend {self.attention_backend!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs: must be >= 1")
        if self.cuda_graph_bs is not None and min(self.cuda_graph_bs) < 1:
            raise ValueError("--cuda-graph-bs: batch sizes must be >= 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy: unknown policy {self.schedule_policy!r}")
        if self.enable_priority_scheduling and self.schedule_policy not in PRIORITY_POLICIES:
            raise ValueError("--enable-priority-scheduling: needs --schedule-policy fcfs or lof (as SGLang)")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("--priority-scheduling-preemption-threshold: must be >= 0")
        for name in (
            "context_length",
            "max_running_requests",
            "max_total_tokens",
            "max_queued_requests",
            "max_request_body_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be positive")
        if self.watchdog_timeout <= 0:
            raise ValueError("--watchdog-timeout: must be positive")
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ValueError("--log-requests-level: must be 0, 1, 2 or 3")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout: must be >= 0")
        if not 0 < self.port < 65536:
            raise ValueError("--port: must be in 1..65535")
        self._resolve_load_format()
        self._validate_parallelism()
        resolve_speculative_args(self)
        self._validate_lora()

    def _validate_lora(self) -> None:
        from tandem.lora.manager import parse_lora_paths, parse_target_modules

        paths = parse_lora_paths(self.lora_paths)
        parse_target_modules(self.lora_target_modules)
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch: must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank: must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < max(len(paths), 1):
            raise ValueError(f"--max-loaded-loras: must be >= 1 and >= the --lora-paths given ({len(paths)})")
        if self.enable_lora and not paths and (self.max_lora_rank is None or not self.lora_target_modules):
            raise ValueError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules")

    def _resolve_load_format(self) -> None:
        """A .gguf path (or a directory of GGUF weights) implies --load-format gguf, as in SGLang;
        SGLang's `--quantization gguf` is accepted with one."""
        from tandem.model_executor.gguf_loader import is_gguf_path

        if self.load_format == "gguf" and not is_gguf_path(self.model_path):
            raise ValueError(f"--load-format gguf: --model-path {self.model_path!r} names no .gguf file")
        if self.load_format in ("auto", "safetensors") and is_gguf_path(self.model_path):
            self.load_format = "gguf"
        if self.quantization == "gguf" and self.load_format != "gguf":
            raise ValueError(f"--quantization gguf: --model-path {self.model_path!r} names no .gguf file")
        if self.quantization in QUANTIZE_AT_LOAD:
            self._check_quantize_at_load()

    def _check_quantize_at_load(self) -> None:
        """`--quantization q8_0|q4_0|q4_1` quantizes a Hugging Face checkpoint for the CPU's
        quantized kernels: refused where they cannot serve it."""
        flag = f"--quantization {self.quantization}"
        if self.load_format == "gguf":
            raise ValueError(
                f"{flag} quantizes a Hugging Face checkpoint at load, but --model-path "
                f"{self.model_path!r} is a GGUF model (served with its own blocks: drop {flag})"
            )
        if self.linear_backend != "auto":
            raise ValueError(
                f"{flag} with --linear-backend {self.linear_backend}: only the auto backend has the quantized kernels"
            )
        if self.device.split(":")[0] != "cpu":
            raise ValueError(f"{flag} with --device {self.device}: the quantized kernels are CPU-only")

    def _validate_parallelism(self) -> None:
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method: unknown method {self.load_balance_method!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank: must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes == 1:
            return
        if self.dist_init_addr is None or ":" not in self.dist_init_addr:
            raise ValueError("--dist-init-addr: HOST:PORT of node 0 is required with --nnodes > 1")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if self.dp_size > 1:
            raise ValueError("--dp-size > 1 with --nnodes > 1 is not built (one TP group spans the nodes)")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--model-path", required=True, help="Hugging Face model directory to serve.")
        add("--tokenizer-path", default=None, help="Tokenizer directory (default: the model path).")
        add("--host", default="127.0.0.1", help="Address the HTTP server binds.")
        add("--port", type=int, default=30000, help="Port of the HTTP server.")
        add(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "bfloat16", "float16"],
            help="Weight and activation dtype; auto = the config's dtype on GPU; on CPU bfloat16 for a "
            "bfloat16/float16 model where the CPU has AVX-512 BF16 or AMX, else float32.",
        )
        add("--device", default=None, help="cpu or cuda (default: cuda when available).")
        add(
            "--context-length",
            type=int,
            default=None,
            help="Longest prompt + output in tokens (default: the model's max_position_embeddings).",
        )
        add(
            "--max-running-requests",
            type=int,
            default=None,
            help="Most requests decoded together (default: 256, capped by the KV capacity).",
        )
        add(
            "--max-total-tokens",
            type=int,
            default=None,
            help="KV cache capacity in tokens (default: from --mem-fraction-static).",
        )
        add(
            "--mem-fraction-static",
            type=float,
            default=None,
            help="Fraction of device memory for weights + KV cache (GPU) or of free RAM for the KV cache (CPU).",
        )
        add(
            "--random-seed",
            type=int,
            default=None,
            help="Seed of the sampler's generator and of --load-format dummy weights (default: random, as SGLang).",
        )
        add("--served-model-name", default=None, help="Model name reported by the API (default: the model path).")
        add("--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")
        add(
            "--log-level-http",
            default=None,
            choices=LOG_LEVELS,
            help="Logging level of the HTTP server (default: --log-level).",
        )
        add("--skip-server-warmup", action="store_true", help="Do not run a warm-up request before serving.")
        add(
            "--incremental-streaming-output",
            action="store_true",
            help="Stream only the new text in each /generate chunk instead of the text so far.",
        )
        add("--max-prefill-tokens", type=int, default=16384, help="Most prompt tokens in one prefill batch.")
        add(
            "--disable-radix-cache",
            action="store_true",
            help="Reuse no cached prefixes (a cache with the same interface that keeps nothing).",
        )
        add(
            "--chunked-prefill-size",
            type=int,
            default=None,
            help="Prefill prompts longer than this in chunks interleaved with decode steps; -1 disables "
            "(default: from the device memory, as SGLang: 2048 under 20 GiB, 4096 under 60, 8192 "
            "under 160, else 16384).",
        )
        add(
            "--schedule-policy",
            default="fcfs",
            choices=list(SCHEDULE_POLICIES),
            help="Order of waiting requests (SGLang's policies): first come first served, longest cached prefix "
            "first, a depth-first walk of the prefix tree (heavier subtrees first), longest output "
            "(max_new_tokens) first, or random.",
        )
        add(
            "--max-queued-requests",
            type=int,
            default=None,
            help="Reject new requests with HTTP 503 while this many are waiting.",
        )
        add(
            "--enable-priority-scheduling",
            action="store_true",
            help="Order waiting requests by their `priority` (then arrival) and preempt running "
            "requests of a lower one; a request without one has the lowest.",
        )
        add(
            "--schedule-low-priority-values-first",
            action="store_true",
            help="With --enable-priority-scheduling: smaller priority values go first (default: larger).",
        )
        add(
            "--priority-scheduling-preemption-threshold",
            type=int,
            default=10,
            help="Preempt a running request only for a waiting one whose priority is better by more than this.",
        )
        add(
            "--skip-tokenizer-init",
            action="store_true",
            help="Load no tokenizer: requests carry input_ids, responses carry output_ids only.",
        )
        add("--stream-interval", type=int, default=1, help="Send a streaming chunk every N decode steps.")
        add(
            "--api-key",
            default=None,
            help="Require 'Authorization: Bearer KEY' on every route except /health and /health_generate.",
        )
        add(
            "--max-request-body-bytes",
            type=int,
            default=32 * 1024 * 1024,
            help="Answer 413 to a request whose body is larger than this (default 32 MiB).",
        )
        add(
            "--chat-template",
            default=None,
            help="Jinja chat template file for /v1/chat/completions (default: the tokenizer's).",
        )
        add(
            "--enable-custom-logit-processor",
            action="store_true",
            help="Accept requests' custom_logit_processor (SGLang's serialized form): the server then "
            "RUNS PYTHON CODE THAT CLIENTS SEND, with its own rights. Only for trusted clients.",
        )
        add(
            "--enable-mixed-chunk",
            action="store_true",
            help="Decode the running requests in the same forward as each prefill batch (or chunk) "
            "instead of pausing them for it.",
        )
        add(
            "--disable-overlap-schedule",
            action="store_true",
            default=None,
            help="Run the normal scheduler loop: process each batch's result before forming the next, "
            "instead of while the next one computes (default on CPU).",
        )
        add(
            "--enable-overlap-schedule",
            dest="disable_overlap_schedule",
            action="store_false",
            default=None,
            help="Run the overlap loop on CPU too (the default on CUDA).",
        )
        add(
            "--watchdog-timeout",
            type=float,
            default=300.0,
            help="If a forward step takes longer than this many seconds, dump the stacks and the batch "
            "to the log and bring the server down (a hung server is worse than none).",
        )
        add(
            "--graceful-shutdown-timeout",
            type=float,
            default=30.0,
            help="On SIGTERM or SIGINT, seconds the running requests get to finish (new ones get 503) "
            "before they are aborted and the server exits; 0 aborts them at once.",
        )
        add(
            "--linear-backend",
            default="auto",
            choices=["auto", "torch"],
            help="Matmul kernel of linear layers: auto = weights prepacked for oneDNN on CPU "
            "(float32/bfloat16), F.linear elsewhere; torch = F.linear on the weights as loaded.",
        )
        add(
            "--attention-backend",
            default=None,
            choices=ATTENTION_BACKENDS,
            help="Attention kernels: triton (the default on CUDA) or torch_native (plain PyTorch, the "
            "default elsewhere).",
        )
        add(
            "--disable-cuda-graph",
            action="store_true",
            help="Run decode eagerly instead of replaying CUDA graphs (CUDA graphs need CUDA, "
            "--attention-backend triton and --tp-size 1; elsewhere decode is always eager).",
        )
        add(
            "--cuda-graph-max-bs",
            "--cuda-graph-max-bs-decode",
            type=int,
            default=None,
            help="Largest decode batch run as a CUDA graph; larger batches run eagerly (default: "
            "--max-running-requests, at most 256). --cuda-graph-max-bs-decode is SGLang's name for the "
            "decode graphs' cap, the only graphs Tandem captures.",
        )
        add(
            "--cuda-graph-bs",
            type=int,
            nargs="+",
            default=None,
            help="The batch sizes to capture (default: 1, 2, 4, 8, then every 8 up to --cuda-graph-max-bs); "
            "sizes above --cuda-graph-max-bs (at most --max-running-requests) give way to that cap; "
            "a batch runs padded to the smallest captured size that holds it.",
        )
        add(
            "--enable-torch-compile",
            action="store_true",
            help="torch_native attention: decode reads the paged KV pool in place through a kernel "
            "compiled by torch.compile (Inductor; needs a C++ compiler), compiled at start "
            "(5-40 s on 2 CPU cores) for every batch size and length; one log line at start says what "
            "it compiles, or why nothing (the C++ CPU decode kernel, or --attention-backend triton).",
        )
        add(
            "--enable-metrics",
            action="store_true",
            help="Serve Prometheus metrics at GET /metrics (SGLang's names and labels).",
        )
        add(
            "--log-requests",
            action="store_true",
            help="Log every request and its outcome; the verbosity is set by --log-requests-level.",
        )
        add(
            "--log-requests-level",
            type=int,
            default=2,
            choices=[0, 1, 2, 3],
            help="0: metadata only; 1: and sampling parameters; 2: and inputs/outputs cut to 2048 "
            "characters or tokens; 3: everything, uncut.",
        )
        add(
            "--constrained-json-disable-any-whitespace",
            action="store_true",
            help="JSON schemas allow no free whitespace: the output is compact, one space after ',' "
            "and ':' (a model cannot loop on whitespace); default: any whitespace, as SGLang.",
        )
        add(
            "--node-rank",
            type=int,
            default=0,
            help="This node's rank among --nnodes (0 runs the HTTP server; the others run only their scheduler ranks).",
        )
        add(
            "--dist-init-addr",
            "--nccl-init-addr",
            default=None,
            help="HOST:PORT of node 0 where the ranks of every node meet (torch.distributed's TCP "
            "rendezvous); required with --nnodes > 1.",
        )
        add(
            "--load-balance-method",
            default="round_robin",
            choices=LOAD_BALANCE_METHODS,
            help="How the data-parallel controller (--dp-size > 1) picks the replica of each request: "
            "in turn, or the one with the fewest requests in flight.",
        )
        add("--enable-lora", action="store_true", help="Serve LoRA adapters (implied by --lora-paths).")
        add(
            "--lora-paths",
            nargs="*",
            default=None,
            help="Adapters loaded at start: name=path, a path (named by itself) or SGLang's JSON "
            '{"lora_name": ..., "lora_path": ...}; PEFT format.',
        )
        add("--max-loras-per-batch", type=int, default=8, help="Adapter slots: most distinct adapters in a batch.")
        add(
            "--max-lora-rank",
            type=int,
            default=None,
            help="Largest adapter rank the slots hold (default: the largest of --lora-paths).",
        )
        add(
            "--lora-target-modules",
            nargs="*",
            default=None,
            help="Modules adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
            "or all (default: those of --lora-paths).",
        )
        add(
            "--max-loaded-loras",
            type=int,
            default=None,
            help="Most adapters loaded (in host memory) at once (default: no limit).",
        )
        add_speculative_args(parser)
        add_compat_args(parser, {f.name: f.default for f in dataclasses.fields(ServerArgs)})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_chunked_prefill_size(device: str) -> int:
    """SGLang's default chunk size for the device's memory (GPU memory, or RAM on CPU); on
    CPU at most 512 tokens per core (at least 1024): a CPU prefill forward is compute-bound
    at any chunk size (1024 tokens of a 100M model take ~0.6 s on 2 cores), so a smaller
    chunk costs little throughput and gives a burst of requests their first tokens sooner
    (docs/perf-log/scheduling.md, "The CPU chunk size": 64 requests at once, median TTFT -15
    to -30% at 1024 vs 4096)."""
    mib = _device_memory_mib(device)
    by_memory = (
        4096
        if mib is None
        else next((size for limit_gib, size in ((20, 2048), (60, 4096), (160, 8192)) if mib < limit_gib * 1024), 16384)
    )
    if device == "cpu":
        return min(by_memory, max(1024, 512 * len(os.sched_getaffinity(0))))
    return by_memory


def _device_memory_mib(device: str) -> float | None:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2**20
    if device == "cpu":
        return psutil.virtual_memory().total / 2**20
    return None


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


@dataclass
class PortArgs:
    """ipc:// endpoints of the pipes between the processes of one server."""

    ipc_dir: str
    tokenizer_to_scheduler: str = field(init=False)
    scheduler_to_detokenizer: str = field(init=False)
    detokenizer_to_tokenizer: str = field(init=False)
    scheduler_to_tokenizer: str = field(init=False)
    ready: str = field(init=False)
    # --dp-size > 1: replicas' control replies and finished requests to the controller.
    scheduler_to_dp_controller: str = field(init=False)

    def __post_init__(self) -> None:
        base = f"ipc://{self.ipc_dir}"
        self.tokenizer_to_scheduler = f"{base}/tokenizer_to_scheduler"
        self.scheduler_to_detokenizer = f"{base}/scheduler_to_detokenizer"
        self.detokenizer_to_tokenizer = f"{base}/detokenizer_to_tokenizer"
        self.scheduler_to_tokenizer = f"{base}/scheduler_to_tokenizer"
        self.ready = f"{base}/ready"
        self.scheduler_to_dp_controller = f"{base}/scheduler_to_dp_controller"

    def dp_scheduler_input(self, dp_rank: int) -> str:
        """The endpoint data-parallel replica `dp_rank`'s rank 0 binds (PULL) under
        --dp-size > 1: what the controller dispatches to it."""
        return f"ipc://{self.ipc_dir}/scheduler_input_dp{dp_rank}"

    def tokenizer_worker(self, worker_id: int) -> str:
        """The endpoint tokenizer worker `worker_id` binds (PULL) under --tokenizer-worker-num
        N > 1: its outputs, control replies and other workers' aborts by label."""
        return f"ipc://{self.ipc_dir}/tokenizer_worker_{worker_id}"

    @classmethod
    def create(cls) -> PortArgs:
        """Make a fresh private directory (mode 0700) for this server's sockets."""
        return cls(ipc_dir=make_ipc_dir())
