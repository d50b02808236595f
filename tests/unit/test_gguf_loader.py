"""Tandem's GGUF loader on what tensor parallelism reads and on variants of real
llama.cpp files (the outputs themselves are checked against transformers in
test_gguf_vs_transformers.py).

- Every tensor-parallel rank (2 and 4 ranks: with 4, the 2 KV heads are replicated)
  loads from a GGUF file exactly the shard it loads from a Hugging Face directory of
  the file's dequantized weights: llama's Q/K rows are un-permuted before the rows of a
  rank are taken.
- A rank's rows are dequantized alone, not the whole tensor (as a safetensors slice
  reads only its rows): the vocabulary-split embedding and head are the largest tensors.
- Files that carry `output.weight` although the model ties it to the embedding (some
  Qwen2 files) are tied, as the Hugging Face config says; a different head is not.
- `general.alignment` other than 32 reads the same weights.
- A tensor that no Tandem parameter takes stops the start when the file is first read
  (in the caller's process: one line), not in the scheduler at load.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from runner_steps import greedy_steps, make_runner
from safetensors.torch import load_file, save_file

from tandem.model_executor.gguf_loader import iterate_gguf_weights
from tandem.model_executor.model_loader import iterate_weights, load_config
from tandem.model_executor.model_runner import check_same_shapes
from tandem.models.registry import resolve_model_class
from tandem.tools.make_tiny_model import make_tiny_model

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch, preset="gguf") for arch in ("llama", "qwen2")}


def dequantized_dir(model_dir, gguf_path, out):
    """`model_dir` with the GGUF file's weights (dequantized, Hugging Face names and rows)."""
    shutil.copytree(model_dir, out)
    save_file(
        {name: w[...].contiguous() for name, w in iterate_weights(str(gguf_path), show_progress=False)},
        str(out / "model.safetensors"),
    )
    return out


def rank_params(path, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    config = load_config(str(path))
    model = resolve_model_class(config)(config, tp_rank=tp_rank, tp_size=tp_size)
    model.load_weights(iterate_weights(str(path), show_progress=False))
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_K"), ("qwen2", "Q8_0")])
def test_each_rank_loads_its_shard_of_the_file(model_dirs, tmp_path, arch, qtype):
    path = write_gguf(model_dirs[arch], tmp_path / f"{arch}.gguf", qtype)
    reference = dequantized_dir(model_dirs[arch], path, tmp_path / "dequantized")
    for tp_size in (2, 4):
        for rank in range(tp_size):
            ours, want = rank_params(path, rank, tp_size), rank_params(reference, rank, tp_size)
            assert ours.keys() == want.keys()
            for name in want:
                assert torch.equal(ours[name], want[name]), (tp_size, rank, name)


def test_a_rank_dequantizes_only_its_rows(model_dirs, tmp_path, monkeypatch):
    path = write_gguf(model_dirs["llama"], tmp_path / "llama.gguf", "Q4_K")
    weights = dict(iterate_gguf_weights(str(path), show_progress=False))
    whole = {name: w[...] for name, w in weights.items()}
    rows_read = []
    real = gguf.quants.dequantize

    def spy(data, qtype):
        rows_read.append(data.shape[0])
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    embed = weights[EMBED]
    assert torch.equal(embed[10:20], whole[EMBED][10:20]) and rows_read == [10]
    q = weights["model.layers.0.self_attn.q_proj.weight"]  # un-permuted rows
    assert torch.equal(q[128:256], whole["model.layers.0.self_attn.q_proj.weight"][128:256])
    down = weights["model.layers.0.mlp.down_proj.weight"]  # a column shard: whole rows
    assert torch.equal(down[:, 384:], whole["model.layers.0.mlp.down_proj.weight"][:, 384:])
    assert rows_read == [10, 128, 512]
    rows_read.clear()
    rank_params(path, 1, 2)  # the vocabulary split: half the embedding's and the head's rows
    vocab = whole[EMBED].shape[0]
    assert vocab not in rows_read and rows_read.count(vocab // 2) == 2, rows_read


def test_output_weight_equal_to_the_embedding_is_tied(model_dirs, tmp_path):
    """Some Qwen2 GGUF files carry `output.weight`, a copy of `token_embd.weight`, though
    the model ties them: Tandem ties them (one matrix, the config of the Hugging Face
    directory, so that a weight update between the two is allowed)."""
    qwen2 = model_dirs["qwen2"]
    with_head = tmp_path / "qwen2-with-head"
    shutil.copytree(qwen2, with_head)
    tensors = load_file(str(qwen2 / "model.safetensors"))
    tensors["lm_head.weight"] = tensors[EMBED].clone()
    save_file(tensors, str(with_head / "model.safetensors"))
    tied_file = write_gguf(qwen2, tmp_path / "tied.gguf", "Q8_0")
    head_file = write_gguf(with_head, tmp_path / "head.gguf", "Q8_0")
    assert "output.weight" in {t.name for t in gguf.GGUFReader(str(head_file)).tensors}
    config = load_config(str(head_file))
    assert config.tie_word_embeddings is True
    check_same_shapes(load_config(str(qwen2)), config)
    prompts = [[1, 5, 9, 13, 2, 7], list(range(1, 40))]
    runner = make_runner(head_file, dtype="float32")
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert greedy_steps(runner, prompts, 4)[0] == greedy_steps(make_runner(tied_file, dtype="float32"), prompts, 4)[0]
    # A head that is not the embedding stays separate (the llama file's own lm_head).
    llama_file = write_gguf(model_dirs["llama"], tmp_path / "llama.gguf", "Q8_0")
    assert load_config(str(llama_file)).tie_word_embeddings is False


@pytest.mark.parametrize("alignment", [64, 4096])
def test_other_alignment_reads_the_same_weights(model_dirs, tmp_path, alignment):
    path = write_gguf(model_dirs["llama"], tmp_path / "aligned.gguf", "Q4_K", alignment=alignment)
    assert gguf.GGUFReader(str(path)).fields["general.alignment"].contents() == alignment
    default = write_gguf(model_dirs["llama"], tmp_path / "default" / "default.gguf", "Q4_K")
    ours = dict(iterate_weights(str(path), show_progress=False))
    want = dict(iterate_weights(str(default), show_progress=False))
    assert ours.keys() == want.keys() and all(torch.equal(ours[n][...], want[n][...]) for n in want)


def test_a_tensor_without_a_counterpart_is_refused_when_the_config_is_read(tmp_path):
    path = tmp_path / "stray.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ("token_embd.weight", "blk.0.attn_rot_embd.weight"):  # an old converter's rotary table
        writer.add_tensor(name, np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.attn_rot_embd.weight'"):
        load_config(str(path))
