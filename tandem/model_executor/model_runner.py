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

import psutil
import torch

from tandem.distributed import tensor_model_parallel_min
from tandem.layers.attention.torch_native import TorchNativeAttnBackend
from tandem.layers.logits_processor import LogitsProcessorOutput
from tandem.layers.sampler import Sampler, SamplingBatchInfo
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from tandem.forward_batch import ForwardBatch
from tandem.model_executor.model_loader import initialize_dummy_weights, iterate_weights, load_config
from tandem.models.llama import ModelContext
from tandem.models.registry import resolve_model_class
from tandem.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Default KV budget on CPU: a fraction of the RAM available at start-up.
CPU_DEFAULT_MEM_FRACTION = 0.1
# Default cap on concurrently running requests.
DEFAULT_MAX_RUNNING_REQUESTS = 256


# Config fields that fix the parameters' shapes: a weight update must keep them.
SHAPE_CONFIG_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


def check_same_shapes(served, new) -> None:
    """ValueError naming the first shape-fixing config field where `new` differs."""
    for key in SHAPE_CONFIG_KEYS:
        if getattr(served, key, None) != getattr(new, key, None):
            raise ValueError(f"the new model's {key} ({getattr(new, key, None)}) differs from the served "
                             f"model's ({getattr(served, key, None)})")


def resolve_dtype(dtype: str, config, device: str) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device == "cpu":
        return torch.float32
    config_dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    if config_dtype in (torch.bfloat16, torch.float16, "bfloat16", "float16"):
        return getattr(torch, config_dtype) if isinstance(config_dtype, str) else config_dtype
    return torch.bfloat16


class ModelRunner:
    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, tp_size: int = 1):
        self.server_args = server_args
        self.device = server_args.device
        self.config = load_config(server_args.model_path)
        self.dtype = resolve_dtype(server_args.dtype, self.config, self.device)
        self.vocab_size = self.config.vocab_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        torch.manual_seed(server_args.random_seed)
        self._load_model(tp_rank, tp_size)
        self.context_len = server_args.context_length or self.config.max_position_embeddings
        self._init_memory_pools()
        self.attn_backend = TorchNativeAttnBackend(self.req_to_token_pool, self.token_to_kv_pool)
        self.ctx = ModelContext(self.token_to_kv_pool, self.attn_backend)
        self.sampler = Sampler(server_args.random_seed, self.device)

    def _load_model(self, tp_rank: int, tp_size: int) -> None:
        self.model = self._build_model(self.server_args.model_path, self.server_args.load_format)
        # The checkpoint the served weights came from (None: dummy weights).
        self.weights_path: str | None = None if self.server_args.load_format == "dummy" else self.server_args.model_path
        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_layers = self.config.num_hidden_layers

    def _build_model(self, model_path: str, load_format: str) -> torch.nn.Module:
        """A new model of `self.config`'s shapes with the weights of `model_path`, prepared
        for serving (packed linear kernels); used at start-up and by weight updates."""
        cls = resolve_model_class(self.config)
        # NOTE: built under a default dtype rather than cast afterwards, so buffers that
        # must stay float32 (the RoPE tables) keep their precision.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        finally:
            torch.set_default_dtype(previous)
        if load_format == "dummy":
            initialize_dummy_weights(model, self.server_args.random_seed)
        else:
            model.load_weights(iterate_weights(model_path, show_progress=self.tp_rank == 0))
        model.process_weights_after_loading(self.server_args.linear_backend)
        return model.eval()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str]:
        """Load `model_path`'s weights into new tensors and swap them in on success; on any
        failure (no such model, another architecture, a missing or misshapen tensor) the
        old weights keep serving. Returns (success, message) in SGLang's words."""
        load_format = load_format or self.server_args.load_format
        try:
            check_same_shapes(self.config, load_config(model_path))
            model = self._build_model(model_path, load_format)
        except Exception as e:  # noqa: BLE001 - reported to the caller; the old weights stay
            logger.error("weight update from %s failed: %s", model_path, e)
            return False, f"Failed to update weights: {type(e).__name__}: {e}. The old weights are kept."
        self.model = model
        self.weights_path = None if load_format == "dummy" else model_path
        return True, "Succeeded to update model weights."

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows (a 1-D tensor: values) of checkpoint tensor `name`
        of the served weights, as float lists. Read from the checkpoint the weights were
        loaded from (the packed linear kernels keep no row-major copy), whole, not this
        rank's shard. Raises ValueError when there is no such tensor."""
        if self.weights_path is None:
            raise ValueError("the served weights are dummy weights (--load-format dummy); none can be read")
        for tensor_name, tensor in iterate_weights(self.weights_path, show_progress=False):
            if tensor_name == name:
                return tensor[:truncate_size].to(torch.float32).tolist()
        raise ValueError(f"no weight named {name!r} in {self.weights_path!r}")

    def _init_memory_pools(self) -> None:
        args = self.server_args
        per_token = TokenToKVPool.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
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
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 4, self.device)
        self.token_to_kv_pool = TokenToKVPool(total, self.num_layers, self.num_kv_heads, self.head_dim,
                                              self.dtype, self.device)
        logger.info("KV cache: %d tokens (%.1f MB), max running requests %d",
                    total, total * per_token / 2**20, self.max_running_requests)

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
        return self.model(fb, self.ctx)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        return self.sampler(logits, info)
