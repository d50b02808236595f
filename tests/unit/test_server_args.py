"""SGLang's flags at parse level: every flag of tandem/sglang_flags.py parses, its
neutral value starts, a no-effect value is accepted with one log line, a not-built value
stops the start naming the flag. SGLang's defaults (random seed, chunk size)."""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from tandem.server_args import ServerArgs, default_chunked_prefill_size
from tandem.sglang_flags import COMPAT_FLAGS

# One non-default value per flag, as a user would pass it.
SET_VALUES = {
    "tp_size": ["0"],
    "dp_size": ["0"],
    "pp_size": ["2"],
    "ep_size": ["2"],
    "nnodes": ["0"],
    "tokenizer_worker_num": ["0"],
    "load_format": ["pt"],
    "page_size": ["16"],
    "kv_cache_dtype": ["fp4_e2m1"],
    "quantization": ["fp8"],
    "lora_paths": ["a=/x", "b=/y"],
    "reasoning_parser": ["glm45"],
    "tool_call_parser": ["glm45"],
    "revision": ["main"],
    "tokenizer_mode": ["slow"],
    "torch_compile_max_bs": ["8"],
    "base_gpu_id": ["-1"],
    "grammar_backend": ["guidance"],
    "sampling_backend": ["flashinfer"],
    "decode_log_interval": ["10"],
}


def _parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/m", *argv]))


def _set_argv(flag) -> list[str]:
    return [flag.names[0], *SET_VALUES.get(flag.dest, [])]


def test_defaults_pass():
    args = _parse()
    assert args.tp_size == 1 and args.load_format == "auto" and not args.trust_remote_code
    args.validate()


@pytest.mark.parametrize("flag", COMPAT_FLAGS, ids=lambda f: f.names[0])
def test_every_sglang_flag(flag, caplog):
    args = _parse(*_set_argv(flag))
    value = getattr(args, flag.dest)
    assert not flag.ok(value), "the test value must be a non-neutral one"
    with caplog.at_level(logging.INFO, logger="tandem.server_args"):
        if flag.no_effect:
            args.validate()
            [line] = [r.getMessage() for r in caplog.records if flag.names[0] in r.getMessage()]
            assert "has no effect here" in line
        else:
            with pytest.raises(ValueError) as e:
                args.validate()
            assert str(e.value).startswith(flag.names[0] + " ")


@pytest.mark.parametrize(
    "argv,dest,value",
    [
        (["--tp", "1"], "tp_size", 1),
        (["--tensor-parallel-size", "1"], "tp_size", 1),
        (["--dp", "1"], "dp_size", 1),
        (["--tp-size", "2"], "tp_size", 2),
        (["--tp", "4"], "tp_size", 4),
        (["--base-gpu-id", "1"], "base_gpu_id", 1),
        (["--tokenizer-worker-num", "1"], "tokenizer_worker_num", 1),
        (["--tokenizer-worker-num", "2"], "tokenizer_worker_num", 2),
        (["--load-format", "dummy"], "load_format", "dummy"),
        (["--load-format", "safetensors"], "load_format", "safetensors"),
        (["--page-size", "1"], "page_size", 1),
        (["--kv-cache-dtype", "auto"], "kv_cache_dtype", "auto"),
        (["--kv-cache-dtype", "fp16"], "kv_cache_dtype", "fp16"),
        (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype", "bfloat16"),
        (["--attention-backend", "torch_native"], "attention_backend", "torch_native"),
        (["--attention-backend", "triton"], "attention_backend", "triton"),
        (["--disable-cuda-graph"], "disable_cuda_graph", True),
        (["--cuda-graph-max-bs", "8"], "cuda_graph_max_bs", 8),
        (["--cuda-graph-max-bs-decode", "8"], "cuda_graph_max_bs", 8),  # SGLang test_srt_endpoint's launch
        (["--cuda-graph-bs", "1", "3"], "cuda_graph_bs", [1, 3]),
        (["--log-level-http", "warning"], "log_level_http", "warning"),
        (["--grammar-backend", "none"], "grammar_backend", "none"),
        (["--tool-call-parser", "llama3"], "tool_call_parser", "llama3"),
        (["--tool-call-parser", "qwen25"], "tool_call_parser", "qwen25"),
        (["--tool-call-parser", "qwen"], "tool_call_parser", "qwen"),
        (["--tool-call-parser", "mistral"], "tool_call_parser", "mistral"),
        (["--tool-call-parser", "pythonic"], "tool_call_parser", "pythonic"),
        (["--tool-call-parser", "lfm2"], "tool_call_parser", "lfm2"),
        (["--dp-size", "2"], "dp_size", 2),
        (["--load-balance-method", "shortest_queue"], "load_balance_method", "shortest_queue"),
        (["--nnodes", "2", "--tp", "2", "--dist-init-addr", "127.0.0.1:5000"], "nnodes", 2),
        (["--nnodes", "2", "--node-rank", "1", "--tp", "2", "--nccl-init-addr", "h:1"], "node_rank", 1),
    ],
)
def test_working_values_pass(argv, dest, value, caplog):
    args = _parse(*argv)
    assert getattr(args, dest) == value
    with caplog.at_level(logging.INFO, logger="tandem.server_args"):
        args.validate()
    assert not caplog.records


def test_sglang_defaults():
    assert _parse().random_seed != _parse().random_seed or _parse().random_seed != _parse().random_seed
    assert _parse("--random-seed", "7").random_seed == 7
    assert _parse("--chunked-prefill-size", "-1").chunked_prefill_size == -1
    assert _parse(*["--device", "cpu"]).chunked_prefill_size == default_chunked_prefill_size("cpu")
    cores = len(os.sched_getaffinity(0))
    assert default_chunked_prefill_size("cpu") == min(max(1024, 512 * cores), default_chunked_prefill_size("mps"))
    assert default_chunked_prefill_size("mps") == 4096


def test_unknown_flag_still_rejected():
    with pytest.raises(SystemExit):
        _parse("--no-such-flag")


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--nnodes", "2", "--tp", "2"], "--dist-init-addr"),
        (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"], "--tp-size"),
        (["--nnodes", "2", "--node-rank", "2", "--tp", "2", "--dist-init-addr", "h:1"], "--node-rank"),
        (["--node-rank", "1"], "--node-rank"),
        (["--nnodes", "2", "--tp", "2", "--dp", "2", "--dist-init-addr", "h:1"], "--dp-size"),
    ],
)
def test_parallelism_refused(argv, flag):
    with pytest.raises(ValueError) as e:
        _parse(*argv).validate()
    assert str(e.value).startswith(flag)


def test_custom_logit_processor_flag_is_off_by_default():
    """SGLang's test_srt_endpoint starts its server with --enable-custom-logit-processor."""
    assert _parse().enable_custom_logit_processor is False
    args = _parse("--enable-custom-logit-processor")
    assert args.enable_custom_logit_processor is True
    args.validate()


def test_overlap_loop_default_follows_the_device():
    """CPU: the normal loop unless --enable-overlap-schedule; the SGLang flag still works."""
    assert _parse("--device", "cpu").disable_overlap_schedule is True
    assert _parse("--device", "cpu", "--enable-overlap-schedule").disable_overlap_schedule is False
    assert _parse("--device", "cpu", "--disable-overlap-schedule").disable_overlap_schedule is True
    assert ServerArgs(model_path="/m", device="cpu").disable_overlap_schedule is True
    assert ServerArgs(model_path="/m", device="cpu", disable_overlap_schedule=False).disable_overlap_schedule is False


def test_mixed_chunk_is_off_unless_asked():
    """SGLang's default on every device (mixing measured slower than pausing with the
    normal loop on CPU: docs/perf-log/scheduling.md)."""
    assert _parse("--device", "cpu").enable_mixed_chunk is False
    assert _parse("--device", "cpu", "--enable-mixed-chunk").enable_mixed_chunk is True


def test_quantization_gguf_goes_with_a_gguf_model():
    args = _parse("--model-path", "/models/m.Q4_K_M.gguf", "--quantization", "gguf")
    args.validate()
    assert args.load_format == "gguf"
    with pytest.raises(ValueError, match="--quantization gguf: --model-path '/m' names no .gguf file"):
        _parse("--quantization", "gguf").validate()
