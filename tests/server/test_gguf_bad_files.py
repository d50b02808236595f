"""Bad GGUF files stop `launch_server` with one line naming the problem: non-zero exit,
no traceback, no process left behind (the server runs in its own session, and none of
that session remains once it has exited)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from gguf_writer import write_gguf

from tandem.utils.process import free_port

START_TIMEOUT_S = 120


def launch(model_path, *extra) -> tuple[int, str]:
    """(exit code, combined output) of a server start that must fail."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.launch_server",
            "--model-path",
            str(model_path),
            "--port",
            str(free_port()),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    with pytest.raises(ProcessLookupError):  # nothing of the server's session is left
        os.killpg(proc.pid, 0)
    return proc.returncode, out


def assert_one_line_error(model_path, *words, extra=()):
    code, out = launch(model_path, *extra)
    assert code != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m tandem.launch_server: error: "), out
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def good_gguf(tiny_llama_gguf_dir, tmp_path_factory):
    return write_gguf(tiny_llama_gguf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0")


def test_wrong_magic(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(1024))
    assert_one_line_error(bad, "model.gguf", "not a GGUF file")


def test_truncated_file(good_gguf, tmp_path):
    data = good_gguf.read_bytes()
    for keep in (64, len(data) // 2, len(data) - 100):  # in the header, in the metadata, in the tensors
        bad = tmp_path / f"cut-{keep}.gguf"
        bad.write_bytes(data[:keep])
        assert_one_line_error(bad, bad.name, "truncated")


def test_unknown_architecture(tiny_llama_gguf_dir, tmp_path):
    bad = write_gguf(tiny_llama_gguf_dir, tmp_path / "arch.gguf", "F16", architecture="falcon")
    assert_one_line_error(bad, "architecture 'falcon' is not supported", "llama")


def test_unsupported_tensor_type(tiny_llama_gguf_dir, tmp_path):
    """Q8_K (llama.cpp's activation type) as a weight: gguf cannot dequantize it."""
    bad = write_gguf(tiny_llama_gguf_dir, tmp_path / "q8k.gguf", "Q8_0", unsupported={"blk.0.ffn_up.weight": "Q8_K"})
    assert_one_line_error(bad, "'blk.0.ffn_up.weight'", "Q8_K")


def test_no_tokenizer_metadata_and_no_tokenizer_path(tiny_llama_gguf_dir, tmp_path):
    bad = write_gguf(tiny_llama_gguf_dir, tmp_path / "notok.gguf", "F32", tokenizer=False)
    assert_one_line_error(bad, "no tokenizer metadata", "--tokenizer-path")


def test_split_set_with_a_part_missing(tiny_llama_gguf_dir, tmp_path):
    first = write_gguf(tiny_llama_gguf_dir, tmp_path / "split.gguf", "F32", split=3)
    assert first.name == "split-00001-of-00003.gguf"
    (tmp_path / "split-00002-of-00003.gguf").unlink()
    assert_one_line_error(first, "lacks split-00002-of-00003.gguf")


def test_directory_with_two_models(good_gguf, tmp_path):
    shutil.copy(good_gguf, tmp_path / "a.gguf")
    shutil.copy(good_gguf, tmp_path / "b.gguf")
    assert_one_line_error(tmp_path, "exactly one GGUF model", "a.gguf, b.gguf")


def test_load_format_gguf_without_a_gguf_file(tiny_llama_gguf_dir):
    assert_one_line_error(tiny_llama_gguf_dir, "--load-format gguf", extra=("--load-format", "gguf"))
