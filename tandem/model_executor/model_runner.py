"""`ModelRunner`: owns the model, the KV pools and the attention backend; runs forwards.

It knows nothing about requests: the scheduler hands it a `ForwardBatch` and receives
logits; sampling is a separate call so the caller decides what to sample with.

Under tensor parallelism there is one ModelRunner per rank, in a process that has joined
the TP group (`tandem.distributed.init_tp_group`): it builds and loads its shard of the
model, and sizes its KV pool (its share of the KV heads) to the smallest size any rank
can hold, so that every rank admits the same requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import torch

from tandem.distributed import tensor_model_parallel_all_gather_object, tensor_model_parallel_min
from tandem.forward_batch import ForwardBatch
from tandem.layers.attention.registry import create_attention_backend, torch_compile_note
from tandem.layers.logits_processor import LogitsProcessorOutput
from tandem.layers.sampler import Sampler, SamplingBatchInfo
from tandem.layers.weight_shard import CheckpointTensor, read_whole
from tandem.lora.manager import LoraManager
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool, widened_pool
from tandem.model_executor.cuda_graph_runner import DEFAULT_MAX_BS, CudaGraphRunner, capture_batch_sizes
from tandem.model_executor.model_loader import initialize_dummy_weights, iterate_weights, load_config
from tandem.models.context import ModelContext
from tandem.models.registry import resolve_model_class
from tandem.server_args import ServerArgs
from tandem.utils.process import release_free_heap

logger = logging.getLogger(__name__)

# Default KV budget on CPU: a fraction of the RAM available at start-up.
CPU_DEFAULT_MEM_FRACTION = 0.1
# Default cap on concurrently running requests.
DEFAULT_MAX_RUNNING_REQUESTS = 256


# Config fields that fix the parameters' shapes: a weight update must keep them.
SHAPE_CONFIG_KEYS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


def check_same_shapes(served, new) -> None:
    """ValueError naming the first shape-fixing config field where `new` differs."""
    for key in SHAPE_CONFIG_KEYS:
        if getattr(served, key, None) != getattr(new, key, None):
            raise ValueError(
                f"the new model's {key} ({getattr(new, key, None)}) differs from the served "
                f"model's ({getattr(served, key, None)})"
            )


def shape_of(tensor: CheckpointTensor) -> list[int]:
    """The shape of a tensor or a safetensors slice (without reading it)."""
    return list(tensor.shape) if isinstance(tensor, torch.Tensor) else list(tensor.get_shape())


@dataclass(frozen=True)
class WeightSource:
    """Where the served weights come from: a checkpoint directory (`path`; None: dummy
    weights), overlaid by the whole tensors that `update_weights_from_tensor` sent since,
    which replace the checkpoint's tensors of the same name. Kept so that a partial
    update can rebuild the model (packed linear layers keep no row-major weight to
    update in place) and `get_weights_by_name` can answer; the overlay costs the sent
    tensors' size in host memory."""

    path: str | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def iterate(self, show_progress: bool = False) -> Iterator[tuple[str, CheckpointTensor]]:
        """Every checkpoint tensor (lazily read), then the overlay; nothing for dummy weights."""
        if self.path is not None:
            yield from (
                (name, t)
                for name, t in iterate_weights(self.path, show_progress=show_progress)
                if name not in self.tensors
            )
        yield from self.tensors.items()

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`; ValueError when there is none."""
        if name in self.tensors:
            return self.tensors[name]
        if self.path is None:
            raise ValueError(
                f"no weight named {name!r}: the served weights are dummy weights "
                "(--load-format dummy) and none can be read"
            )
        for tensor_name, tensor in iterate_weights(self.path, show_progress=False):
            if tensor_name == name:
                return read_whole(tensor)
        raise ValueError(f"no weight named {name!r} in {self.path!r}")


_HALF_DTYPES = (torch.bfloat16, torch.float16, "bfloat16", "float16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str, config, device: str, native_bf16: bool | None = None) -> torch.dtype:
    """`--dtype`; `auto` is the checkpoint's half dtype on GPU (bfloat16 for a float32 one),
    and on CPU bfloat16 for a bfloat16/float16 checkpoint where the CPU has native bfloat16
    (`native_bf16`, detected when None), float32 otherwise: a float32 checkpoint stays exact,
    and without native bfloat16 every bfloat16 multiply is emulated through conversions
    (docs/perf-log/cpu-decode.md, "`--dtype auto` on CPU")."""
    if dtype != "auto":
        return getattr(torch, dtype)
    config_dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    if device == "cpu":
        half = config_dtype in _HALF_DTYPES
        native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        return torch.bfloat16 if half and native else torch.float32
    if config_dtype in _HALF_DTYPES:
        return getattr(torch, config_dtype) if isinstance(config_dtype, str) else config_dtype
    return torch.bfloat16


_KV_DTYPE_NAMES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8_e5m2": "float8_e5m2",
    "fp8_e4m3": "float8_e4m3fn",
}


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: torch.dtype, device: str, quantized: bool = False
) -> torch.dtype:
    """`--kv-cache-dtype`. auto: the activations' `dtype`, but float16 on CPU where linear layers
    run `quantized`, float32 activations rounded to int8 for them (a GGUF file's blocks or
    --quantization q* under --dtype auto; no exact float32 reference any more), as llama.cpp
    keeps the same file's cache: half the bytes a decode step's attention reads (0.80-0.91 of
    the step of the default model's Q4_0 file on 2 Zen 3 cores, docs/perf-log/kv-cache-dtype.md).
    A dtype by name must be the activations', or on CPU a narrower pool (`widened_pool`:
    bfloat16 / float16 beside float32 activations, fp8_e5m2 / fp8_e4m3 beside float32 or bfloat16
    ones; keys and values rounded as they are written, with no scale, and widened as attention
    reads them). ValueError for any other pair."""
    if kv_cache_dtype == "auto":
        return torch.float16 if quantized and device == "cpu" and dtype == torch.float32 else dtype
    kv = getattr(torch, _KV_DTYPE_NAMES.get(kv_cache_dtype, kv_cache_dtype))
    if kv == dtype or (device == "cpu" and widened_pool(dtype, kv)):
        return kv
    where = "on CPU" if device == "cpu" else f"on {device} (a KV dtype other than the activations' is CPU-only)"
    raise ValueError(
        f"--kv-cache-dtype {kv_cache_dtype} with {str(dtype).removeprefix('torch.')} activations {where}: "
        "the KV cache takes the activations' dtype, or on CPU bfloat16 / float16 beside float32 activations "
        "and fp8_e5m2 / fp8_e4m3 beside float32 or bfloat16 ones"
    )


class ModelRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        tp_rank: int = 0,
        tp_size: int = 1,
        req_to_token_pool: ReqToTokenPool | None = None,
    ):
        """`req_to_token_pool`: another runner's rows to share (a speculative draft model
        keeps its KV in its own pool at the target's slots); None: its own."""
        self.server_args = server_args
        self._shared_rows = req_to_token_pool
        self.device = server_args.device
        self.config = load_config(server_args.model_path)
        self.dtype = resolve_dtype(server_args.dtype, self.config, self.device)
        self.vocab_size = self.config.vocab_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        torch.manual_seed(server_args.random_seed)
        self._load_model(tp_rank, tp_size)
        # Linear layers whose quantized kernels round float32 activations to int8 (a GGUF file's blocks or
        # --quantization q* under --dtype auto): auto keeps their KV in float16.
        quantized = any(getattr(getattr(m, "quant_kernel", None), "int8_x", False) for m in self.model.modules())
        self.kv_cache_dtype = resolve_kv_cache_dtype(server_args.kv_cache_dtype, self.dtype, self.device, quantized)
        self.context_len = server_args.context_length or self.config.max_position_embeddings
        self._init_memory_pools()
        self.attn_backend = create_attention_backend(
            server_args.attention_backend,
            self.req_to_token_pool,
            self.token_to_kv_pool,
            self.model.model.layers[0].self_attn.num_heads,
            self.head_dim,
            server_args.enable_torch_compile,
        )
        if server_args.enable_torch_compile and tp_rank == 0:
            logger.info(torch_compile_note(self.attn_backend, server_args.attention_backend))
        self.ctx = ModelContext(self.token_to_kv_pool, self.attn_backend)
        self.lora = LoraManager(self.model, server_args, self.dtype, self.device) if server_args.enable_lora else None
        self.cuda_graph_runner = self._init_cuda_graphs()
        self.sampler = Sampler(server_args.random_seed, self.device)

    def _load_model(self, tp_rank: int, tp_size: int) -> None:
        args = self.server_args
        self.weight_source = WeightSource(None if args.load_format == "dummy" else args.model_path)
        self.model = self._build_model(self.weight_source, show_progress=tp_rank == 0)
        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_layers = self.config.num_hidden_layers

    def _build_model(self, source: WeightSource, show_progress: bool = False) -> torch.nn.Module:
        """A new model of `self.config`'s shapes with `source`'s weights, prepared for
        serving (packed linear kernels); used at start-up and by weight updates."""
        cls = resolve_model_class(self.config)
        # NOTE: built under a default dtype rather than cast afterwards: parameters and the
        # RoPE tables (layers/rotary.py) are made in the model's dtype from float32 values.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        finally:
            torch.set_default_dtype(previous)
        if source.path is None:
            initialize_dummy_weights(model, self.server_args.random_seed)
        model.load_weights(source.iterate(show_progress), require_all=source.path is not None)
        # Quantized matmuls round their rows to int8 (llama.cpp's recipe, as bfloat16 rows always
        # are), float32 ones too, unless float32 was asked for by name: then they stay exact.
        int8_x = self.server_args.dtype != "float32"
        model.process_weights_after_loading(self.server_args.linear_backend, self.server_args.quantization, int8_x)
        release_free_heap()
        return model.eval()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str]:
        """Serve `model_path`'s weights (same architecture); see `_replace_weights`."""
        load_format = load_format or self.server_args.load_format

        def build() -> tuple[WeightSource, torch.nn.Module]:
            check_same_shapes(self.config, load_config(model_path))
            source = WeightSource(None if load_format == "dummy" else model_path)
            return source, self._build_model(source)

        return self._replace_weights(build, f"from {model_path}")

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None = None
    ) -> tuple[bool, str]:
        """Replace the named checkpoint tensors (whole tensors: each rank takes its shard);
        the others keep their values. See `_replace_weights`."""

        def build() -> tuple[WeightSource, torch.nn.Module]:
            if load_format not in (None, "direct"):
                raise ValueError(f"load_format: {load_format!r} is not supported here (only None or 'direct')")
            served = {name: shape_of(t) for name, t in self.weight_source.iterate()}
            for name, tensor in named_tensors:
                if name in served and list(tensor.shape) != served[name]:
                    raise ValueError(
                        f"{name}: shape {list(tensor.shape)} differs from the served weight's {served[name]}"
                    )
            source = WeightSource(self.weight_source.path, {**self.weight_source.tensors, **dict(named_tensors)})
            return source, self._build_model(source)

        return self._replace_weights(build, "from tensors")

    def _replace_weights(self, build, what: str) -> tuple[bool, str]:
        """Build the new model beside the served one and swap it in only if every TP rank
        built its shard; on any failure (no such model, another architecture, a missing
        or misshapen tensor, on any rank) every rank keeps the old weights. Returns
        (success, message) in SGLang's words; the message names a failing rank under TP."""
        error, new = None, None
        try:
            new = build()
        except Exception as e:  # noqa: BLE001 - reported to the caller; the old weights stay
            error = f"{type(e).__name__}: {e}"
        if self.tp_size > 1:
            errors = tensor_model_parallel_all_gather_object(error)
            error = next((f"TP rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None), None)
        if error is not None:
            logger.error("weight update %s failed: %s", what, error)
            return False, f"Failed to update weights: {error}. The old weights are kept."
        self.weight_source, self.model = new
        if self.lora is not None:  # the new model's layers read the same adapter slots
            self.lora.pool.attach(self.model)
        if self.cuda_graph_runner is not None:  # the graphs hold the old parameters
            self.cuda_graph_runner.capture()
        return True, "Succeeded to update model weights."

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows (a 1-D tensor: values) of checkpoint tensor `name`
        of the served weights, as float lists: whole, not this rank's shard, read from
        the served `WeightSource` (the packed linear kernels keep no row-major copy).
        Raises ValueError when there is no such tensor."""
        return self.weight_source.read(name)[:truncate_size].to(torch.float32).tolist()

    def _init_memory_pools(self) -> None:
        args = self.server_args
        per_token = TokenToKVPool.bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv_cache_dtype
        )
        max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        if args.max_total_tokens:
            total = args.max_total_tokens
        else:
            total = self._tokens_from_memory(per_token)
            total = min(total, max_running * self.context_len)
            if self.tp_size > 1:
                total = tensor_model_parallel_min(total, self.device)
        if total < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or raise --max-total-tokens")
        self.max_total_num_tokens = total
        self.max_running_requests = min(max_running, total)
        self.req_to_token_pool = self._shared_rows or ReqToTokenPool(
            self.max_running_requests, self.context_len + 4, self.device
        )
        self.token_to_kv_pool = TokenToKVPool(
            total, self.num_layers, self.num_kv_heads, self.head_dim, self.kv_cache_dtype, self.device
        )
        logger.info(
            "KV cache: %d tokens (%.1f MB, %s), max running requests %d",
            total,
            total * per_token / 2**20,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.max_running_requests,
        )

    def _tokens_from_memory(self, per_token: int) -> int:
        frac = self.server_args.mem_fraction_static
        if self.device.startswith("cuda"):
            free, total = torch.cuda.mem_get_info()
            used_by_others = total - free
            budget = total * (frac or 0.85) - used_by_others
        else:  # the ranks of a TP group share this machine's RAM
            budget = psutil.virtual_memory().available * (frac or CPU_DEFAULT_MEM_FRACTION) / self.tp_size
        return int(max(budget, 0) // per_token)

    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """Next-token logits [bs, vocab] (float32), and prompt logprobs where asked."""
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(fb):
            return self.cuda_graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        if self.lora is not None:
            return self.model(fb, self.ctx.with_lora(self.lora.batch_for(fb.lora_uids, fb.extend_lens_cpu)))
        return self.model(fb, self.ctx)

    def _init_cuda_graphs(self) -> CudaGraphRunner | None:
        """Decode CUDA graphs where they can run: CUDA, a backend that supports them, one
        rank, and not --disable-cuda-graph."""
        args = self.server_args
        if not self.device.startswith("cuda") or args.disable_cuda_graph:
            return None
        if args.enable_lora:
            logger.info("CUDA graphs off: --enable-lora (the adapters' segments change every batch)")
            return None
        if not self.attn_backend.supports_cuda_graph or self.tp_size > 1:
            logger.info("CUDA graphs off: they need --attention-backend triton and --tp-size 1")
            return None
        max_bs = min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, self.max_running_requests)
        return CudaGraphRunner(
            lambda fb: self.model(fb, self.ctx),
            self.attn_backend,
            capture_batch_sizes(max_bs, args.cuda_graph_bs),
            self.vocab_size,
            self.device,
        )

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        return self.sampler(logits, info)
