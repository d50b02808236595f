"""Tensor parallelism without a server: the head split, the column layers' shards (no
communication, so in-process), and on 2 gloo processes the layers that communicate, the
whole model (tp 2 logits equal tp 1's; KV heads replicated on the one-KV-head model; an
odd vocabulary padded) and sampling (the same tokens on every rank, seeded or not)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tandem.distributed import TpGroup, init_tp_group
from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.layers.linear import (
    ColumnParallelLinear,
    HeadSplit,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tandem.layers.sampler import Sampler, SamplingBatchInfo
from tandem.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, VocabShard
from tandem.sampling.sampling_params import SamplingParams


def run_on_ranks(fn, world_size: int, tmp_path, *args) -> list:
    """`fn(tp_group, *args)` on `world_size` spawned gloo ranks; each rank's return value."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_entry, args=(fn, world_size, str(tmp_path), args), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _rank_entry(rank: int, fn, world_size: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(rank, world_size, "cpu", f"file://{tmp}/rendezvous")
    try:
        torch.save(fn(tp, *args), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ in-process: the shards


@pytest.mark.parametrize(
    "heads,kv_heads,tp,expected",
    [
        (4, 2, 2, [(2, 1, 0), (2, 1, 1)]),
        (8, 8, 4, [(2, 2, 0), (2, 2, 2), (2, 2, 4), (2, 2, 6)]),
        # Fewer KV heads than ranks: each holds the KV head its query heads attend to.
        (4, 2, 4, [(1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]),
        (4, 1, 2, [(2, 1, 0), (2, 1, 0)]),
        (8, 2, 8, [(1, 1, r // 4) for r in range(8)]),
    ],
)
def test_head_split(heads, kv_heads, tp, expected):
    assert [tuple(vars(HeadSplit.of(heads, kv_heads, r, tp)).values()) for r in range(tp)] == expected
    for r, (num_heads, num_kv, kv_start) in enumerate(expected):  # GQA: query head h reads KV head h*kv//heads
        wanted = {h * kv_heads // heads for h in range(r * num_heads, (r + 1) * num_heads)}
        assert wanted == set(range(kv_start, kv_start + num_kv))


@pytest.mark.parametrize(
    "heads,kv_heads,tp,message",
    [
        (4, 2, 3, "does not divide the model's attention heads"),
        (6, 4, 3, "does not divide the model's KV heads"),
        (6, 2, 6, None),
        (8, 3, 4, "is not a multiple of the model's KV heads"),
        (12, 4, 6, "is not a multiple of the model's KV heads"),
    ],
)
def test_head_split_refuses_shapes_it_cannot_split(heads, kv_heads, tp, message):
    if message is None:
        HeadSplit.of(heads, kv_heads, 0, tp)
        return
    with pytest.raises(ValueError, match=message):
        HeadSplit.of(heads, kv_heads, 0, tp)


def test_column_shards_concatenate_to_the_whole_layer():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    w, b = torch.randn(12, 8), torch.randn(12)
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    outs, fused = [], []
    for rank in range(2):
        col = ColumnParallelLinear(8, 12, bias=True, tp_rank=rank, tp_size=2)
        col.weight_loader(col.weight, w)
        col.weight_loader(col.bias, b)
        outs.append(col(x))
        merged = MergedColumnParallelLinear(8, [6, 6], tp_rank=rank, tp_size=2)
        merged.weight_loader(merged.weight, gate, 0)
        merged.weight_loader(merged.weight, up, 1)
        fused.append(merged(x).chunk(2, dim=-1))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))
    torch.testing.assert_close(torch.cat([g for g, _ in fused], -1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat([u for _, u in fused], -1), F.linear(x, up))


def test_qkv_replicates_the_kv_head_of_each_rank():
    """4 query heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1."""
    head_dim, hidden = 2, 6
    q, k, v = (
        torch.arange(n * head_dim * hidden, dtype=torch.float32).reshape(n * head_dim, hidden) + off
        for n, off in ((4, 0), (2, 1000), (2, 2000))
    )
    for rank in range(4):
        layer = QKVParallelLinear(hidden, head_dim, 4, 2, tp_rank=rank, tp_size=4)
        for name, t in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, t, name)
        wq, wk, wv = layer.weight.split([head_dim, head_dim, head_dim])
        kv_head = rank // 2
        assert torch.equal(wq, q[rank * head_dim : (rank + 1) * head_dim])
        assert torch.equal(wk, k[kv_head * head_dim : (kv_head + 1) * head_dim])
        assert torch.equal(wv, v[kv_head * head_dim : (kv_head + 1) * head_dim])


def test_vocab_shards_pad_an_odd_vocabulary():
    shards = [VocabShard.of(11, r, 2) for r in range(2)]
    assert [(s.start, s.end, s.size) for s in shards] == [(0, 6, 6), (6, 11, 6)]
    full = torch.randn(11, 4)
    param = torch.nn.Parameter(torch.full((6, 4), 7.0), requires_grad=False)
    shards[1].load(param, full)
    assert torch.equal(param[:5], full[6:]) and torch.equal(param[5], torch.zeros(4))


# ------------------------------------------------------------------ 2 gloo ranks: the layers


def _layers_on_rank(tp: TpGroup) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    w1, b1, w2, b2 = (
        torch.randn(12, 8, generator=g),
        torch.randn(12, generator=g),
        torch.randn(8, 12, generator=g),
        torch.randn(8, generator=g),
    )
    table = torch.randn(11, 8, generator=g)  # an odd vocabulary: rank 1 holds a padding row
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    col = ColumnParallelLinear(8, 12, bias=True, tp_rank=tp.rank, tp_size=tp.size)
    row = RowParallelLinear(12, 8, bias=True, tp_rank=tp.rank, tp_size=tp.size)
    for layer, w, b in ((col, w1, b1), (row, w2, b2)):
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        layer.process_weights_after_loading("auto")
    embed = VocabParallelEmbedding(11, 8, tp.rank, tp.size)
    embed.weight_loader(embed.weight, table)
    head = ParallelLMHead(11, 8, tp.rank, tp.size)
    head.weight = embed.weight  # tied, as Qwen2's
    head.process_weights_after_loading("auto", keep_weight=True)
    logits = head(x)
    params = [SamplingParams(temperature=1.0, sampling_seed=s) for s in (None, 7, None, 11, None)]
    info = SamplingBatchInfo(params, [0, 3, 0, 1, 0], 11, "cpu")
    sampler = Sampler(seed=5, device="cpu")
    samples = [sampler(logits * 0.2, info) for _ in range(3)]
    return {
        "mlp": row(col(x)),
        "embed": embed(ids),
        "logits": logits,
        "samples": samples,
        "expected_mlp": F.linear(F.linear(x, w1, b1), w2, b2),
        "expected_embed": F.embedding(ids, table),
        "expected_logits": F.linear(x, table),
    }


@pytest.mark.slow  # two gloo ranks in subprocesses
def test_parallel_layers_on_two_ranks(tmp_path):
    ranks = run_on_ranks(_layers_on_rank, 2, tmp_path)
    for out in ranks:
        torch.testing.assert_close(out["mlp"], out["expected_mlp"], rtol=1e-5, atol=1e-5)
        assert torch.equal(out["embed"], out["expected_embed"])  # one non-zero term per sum: exact
        assert out["logits"].shape == (5, 11)
        torch.testing.assert_close(out["logits"], out["expected_logits"], rtol=1e-5, atol=1e-5)
    # Every rank ends with the same bytes, and so samples the same tokens, seeded or not.
    for key in ("mlp", "embed", "logits"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["samples"], ranks[1]["samples"]))
    assert len({tuple(s.tolist()) for s in ranks[0]["samples"]}) > 1  # unseeded rows did vary


# ------------------------------------------------------------------ 2 gloo ranks: the model


PROMPTS = [[1, 20, 300, 40, 500, 60, 700], [1, 900, 33, 1200]]
DECODE_STEPS = 3


def _generate_on_rank(tp: TpGroup, model_dirs: list[str]) -> dict:
    """Per model: logits of a prefill of PROMPTS and of greedy decode steps, and tokens
    sampled at temperature 1 (two requests seeded, one not)."""
    from tandem.model_executor.model_runner import ModelRunner
    from tandem.server_args import ServerArgs

    results = {}
    for model_dir in model_dirs:
        args = ServerArgs(
            model_path=model_dir,
            device="cpu",
            max_total_tokens=64,
            max_running_requests=4,
            random_seed=3,
            chunked_prefill_size=-1,
        )
        runner = ModelRunner(args, tp.rank, tp.size)
        seqs = [list(p) for p in PROMPTS]
        slots = [list(range(1 + 20 * i, 1 + 20 * i + 20)) for i in range(len(seqs))]
        for i, row in enumerate(slots):
            runner.req_to_token_pool.write(i, 0, torch.tensor(row))
        fb = ForwardBatch.for_rows(
            ForwardMode.EXTEND, [t for s in seqs for t in s], [0] * len(seqs), [len(s) for s in seqs], slots
        )
        logits = [runner.forward(fb).next_token_logits]
        for _ in range(DECODE_STEPS):
            for s, nxt in zip(seqs, logits[-1].argmax(-1).tolist()):
                s.append(nxt)
            fb = ForwardBatch.for_rows(
                ForwardMode.DECODE, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], [1] * len(seqs), slots
            )
            logits.append(runner.forward(fb).next_token_logits)
        params = [SamplingParams(temperature=1.0, sampling_seed=s) for s in (5, None, 9)]
        info = SamplingBatchInfo(params, [0, 0, 4], runner.vocab_size, "cpu")
        batch_logits = torch.cat([logits[-1], logits[-1][:1]])
        sampled = [runner.sample(batch_logits, info).tolist() for _ in range(4)]
        results[model_dir] = {
            "logits": logits,
            "sampled": sampled,
            "kv_tokens": runner.max_total_num_tokens,
            "kv_heads": runner.num_kv_heads,
        }
    return results


@pytest.mark.slow  # two gloo ranks in subprocesses
def test_model_on_two_ranks_equals_one(tmp_path, tiny_llama_dir, tiny_qwen2_dir, tiny_mqa_dir):
    """llama: heads, KV heads, vocabulary and intermediate size divide; qwen2: an odd
    vocabulary (1531, padded), tied head, q/k/v bias; mqa: one KV head, replicated."""
    dirs = [str(tiny_llama_dir), str(tiny_qwen2_dir), str(tiny_mqa_dir)]
    single = _generate_on_rank(TpGroup(), dirs)
    ranks = run_on_ranks(_generate_on_rank, 2, tmp_path / "ranks", dirs)
    for d in dirs:
        for r in ranks:
            assert len(r[d]["logits"]) == DECODE_STEPS + 1
            for got, want in zip(r[d]["logits"], single[d]["logits"]):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][d]["logits"], ranks[1][d]["logits"])), d
        assert ranks[0][d]["sampled"] == ranks[1][d]["sampled"], d
        assert ranks[0][d]["kv_tokens"] == ranks[1][d]["kv_tokens"] == 64
    assert [ranks[0][d]["kv_heads"] for d in dirs] == [1, 1, 1]
    assert [single[d]["kv_heads"] for d in dirs] == [2, 2, 1]
