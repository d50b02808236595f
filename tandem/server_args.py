"""Server configuration: `ServerArgs` (the CLI flags, SGLang's names) and `PortArgs`.

`ServerArgs` is created once in the main process, resolved (defaults that depend on the
model are filled in later by the scheduler and reported back), and passed by value to
every subprocess. `PortArgs` holds the `ipc://` endpoints of one server, all inside a
private 0700 temporary directory, so two servers on one machine never collide.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field


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
    random_seed: int = 0
    served_model_name: str | None = None
    log_level: str = "info"
    skip_server_warmup: bool = False
    incremental_streaming_output: bool = False
    max_prefill_tokens: int = 16384
    stream_interval: int = 1
    skip_tokenizer_init: bool = False
    disable_radix_cache: bool = False
    chunked_prefill_size: int = 2048
    schedule_policy: str = "fcfs"
    max_queued_requests: int | None = None
    api_key: str | None = None
    chat_template: str | None = None
    linear_backend: str = "auto"
    enable_mixed_chunk: bool = False

    def __post_init__(self) -> None:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.device is None:
            self.device = _default_device()

    def validate(self) -> None:
        """Raise ValueError for values that can never work, naming the flag."""
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
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy: unknown policy {self.schedule_policy!r}")
        for name in ("context_length", "max_running_requests", "max_total_tokens", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be positive")
        if not 0 < self.port < 65536:
            raise ValueError("--port: must be in 1..65535")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--model-path", required=True, help="Hugging Face model directory to serve.")
        add("--tokenizer-path", default=None, help="Tokenizer directory (default: the model path).")
        add("--host", default="127.0.0.1", help="Address the HTTP server binds.")
        add("--port", type=int, default=30000, help="Port of the HTTP server.")
        add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
            help="Weight and activation dtype; auto = float32 on CPU, the config's dtype on GPU.")
        add("--device", default=None, help="cpu or cuda (default: cuda when available).")
        add("--context-length", type=int, default=None,
            help="Longest prompt + output in tokens (default: the model's max_position_embeddings).")
        add("--max-running-requests", type=int, default=None,
            help="Most requests decoded together (default: 256, capped by the KV capacity).")
        add("--max-total-tokens", type=int, default=None,
            help="KV cache capacity in tokens (default: from --mem-fraction-static).")
        add("--mem-fraction-static", type=float, default=None,
            help="Fraction of device memory for weights + KV cache (GPU) or of free RAM for the KV cache (CPU).")
        add("--random-seed", type=int, default=0, help="Seed of the sampler's generator.")
        add("--served-model-name", default=None, help="Model name reported by the API (default: the model path).")
        add("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="Logging level.")
        add("--skip-server-warmup", action="store_true", help="Do not run a warm-up request before serving.")
        add("--incremental-streaming-output", action="store_true",
            help="Stream only the new text in each /generate chunk instead of the text so far.")
        add("--max-prefill-tokens", type=int, default=16384, help="Most prompt tokens in one prefill batch.")
        add("--disable-radix-cache", action="store_true",
            help="Reuse no cached prefixes (a cache with the same interface that keeps nothing).")
        add("--chunked-prefill-size", type=int, default=2048,
            help="Prefill prompts longer than this in chunks interleaved with decode steps; -1 disables.")
        add("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"],
            help="Order of waiting requests: first come first served, or longest cached prefix first.")
        add("--max-queued-requests", type=int, default=None,
            help="Reject new requests with HTTP 503 while this many are waiting.")
        add("--skip-tokenizer-init", action="store_true",
            help="Load no tokenizer: requests carry input_ids, responses carry output_ids only.")
        add("--stream-interval", type=int, default=1, help="Send a streaming chunk every N decode steps.")
        add("--api-key", default=None,
            help="Require 'Authorization: Bearer KEY' on every route except /health and /health_generate.")
        add("--chat-template", default=None,
            help="Jinja chat template file for /v1/chat/completions (default: the tokenizer's).")
        add("--enable-mixed-chunk", action="store_true",
            help="Decode the running requests in the same forward as each prefill batch (or chunk) "
                 "instead of pausing them for it.")
        add("--linear-backend", default="auto", choices=["auto", "torch"],
            help="Matmul kernel of linear layers: auto = weights prepacked for oneDNN on CPU "
                 "(float32/bfloat16), F.linear elsewhere; torch = F.linear on the weights as loaded.")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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

    def __post_init__(self) -> None:
        base = f"ipc://{self.ipc_dir}"
        self.tokenizer_to_scheduler = f"{base}/tokenizer_to_scheduler"
        self.scheduler_to_detokenizer = f"{base}/scheduler_to_detokenizer"
        self.detokenizer_to_tokenizer = f"{base}/detokenizer_to_tokenizer"
        self.scheduler_to_tokenizer = f"{base}/scheduler_to_tokenizer"
        self.ready = f"{base}/ready"

    @classmethod
    def create(cls) -> "PortArgs":
        """Make a fresh private directory (mode 0700) for this server's sockets."""
        ipc_dir = tempfile.mkdtemp(prefix="tandem-ipc-")
        os.chmod(ipc_dir, 0o700)
        return cls(ipc_dir=ipc_dir)
