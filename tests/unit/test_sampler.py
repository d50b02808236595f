"""The sampler: greedy, the top-k / top-p / min-p filters, and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.sampler import (
    Sampler,
    SamplingBatchInfo,
    _filter_probs,
    bits_to_uniform,
    categorical,
    generator_uniforms,
    greedy,
    sampling_probs,
    seeded_uniforms,
)
from tandem.sampling.sampling_params import SamplingParams


def info(params: list[SamplingParams], vocab: int = 6, output_lens: list[int] | None = None) -> SamplingBatchInfo:
    return SamplingBatchInfo(params, output_lens or [0] * len(params), vocab, "cpu")


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    out = Sampler(0, "cpu")(logits, info([SamplingParams(temperature=0)] * 2, vocab=3))
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize("shape", [(1, 49152), (3, 4099), (2, 17), (4, 1), (1, 100003)])
def test_greedy_kernel_picks_torch_argmax_ids(shape):
    """The C++ argmax (float32 rows on CPU) against torch.argmax: random rows, rows of few
    distinct values (ties: the first), a NaN anywhere (the first NaN), all -inf (the first)."""
    if cpu_kernels.load() is None:
        pytest.skip("Tandem's C++ CPU kernels could not be built here")
    g = torch.Generator().manual_seed(shape[1])
    for trial in range(40):
        x = torch.randn(*shape, generator=g)
        if trial % 4 == 1:
            x = torch.randint(-3, 3, shape, generator=g).float()
        if trial % 4 == 2:
            x[:, torch.randint(0, shape[1], (2,), generator=g)] = float("nan")
        if trial % 4 == 3:
            x = torch.full(shape, -float("inf"))
        assert torch.equal(cpu_kernels.load().argmax_rows(x), torch.argmax(x, -1)), (shape, trial)
        assert torch.equal(greedy(x), torch.argmax(x, -1))
    wide = torch.randn(2, 64, generator=g)[:, ::2]  # strided rows: torch's argmax
    assert torch.equal(greedy(wide), torch.argmax(wide, -1))


def test_filters():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    keep = lambda k, p, m: (_filter_probs(probs, torch.tensor([k]), torch.tensor([p]), torch.tensor([m])) > 0)[
        0
    ].tolist()
    assert keep(2, 1.0, 0.0) == [True, True, False, False]
    assert keep(4, 0.7, 0.0) == [True, True, False, False]  # 0.5 < 0.7, then 0.8 >= 0.7
    assert keep(4, 0.45, 0.0) == [True, False, False, False]
    assert keep(4, 1.0, 0.5) == [True, True, False, False]  # >= 0.5 * 0.5
    assert keep(4, 1.0, 0.0) == [True, True, True, True]


def _kept_by_definition(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a row keeps, by the filters' definitions in plain Python: rank below top_k,
    mass strictly before the token within top_p (unless top_p is 1), at least min_p * max."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept, mass = set(), 0.0
    for rank, i in enumerate(order):
        if rank < top_k and (top_p >= 1 or mass <= top_p) and row[i] >= row[order[0]] * min_p:
            kept.add(i)
        mass += row[i]
    return kept


def test_filters_keep_what_the_definitions_keep():
    """Rows whose decision the 256 / 4096 largest probabilities settle (peaked), and rows that
    need the whole sort (flat, or a top_k above the candidates), in one batch with rows that
    filter nothing (left exactly as they are) and rows with min-p only."""
    g = torch.Generator().manual_seed(3)
    vocab = 6000
    spreads = [8.0, 8.0, 0.3, 0.3, 2.0, 1.0, 8.0, 0.3]
    logits = torch.stack([torch.randn(vocab, generator=g) * s for s in spreads])
    probs = torch.softmax(logits, dim=-1)
    filters = [(vocab, 0.9, 0.0), (40, 1.0, 0.0), (vocab, 0.95, 0.0), (5000, 0.99, 0.0),
               (vocab, 1.0, 0.0), (vocab, 1.0, 0.2), (7, 0.5, 0.01), (vocab, 1.0, 0.0)]  # fmt: skip
    top_ks, top_ps, min_ps = (torch.tensor(col) for col in zip(*filters))
    out = _filter_probs(probs, top_ks, top_ps.float(), min_ps.float())
    for r, (k, p, m) in enumerate(filters):
        kept = set(torch.nonzero(out[r]).flatten().tolist())
        assert kept == _kept_by_definition(probs[r].tolist(), k, p, m), r
        assert torch.equal(out[r][list(kept)], probs[r][list(kept)])
    assert torch.equal(out[4], probs[4]) and torch.equal(out[7], probs[7])
    assert len(_kept_by_definition(probs[2].tolist(), vocab, 0.95, 0.0)) > 4096  # the whole sort ran


def test_categorical_draws_by_probability_and_never_a_zero():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0, 0.0]]).expand(100000, -1).contiguous()
    counts = torch.bincount(categorical(probs, generator_uniforms(probs, g)), minlength=6).float() / 100000
    assert counts[1] == counts[4] == counts[5] == 0
    assert torch.allclose(counts, probs[0], atol=0.01), counts
    tiny = torch.tensor([[1e-30, 0.0, 3e-30, 0.0]])  # a sum far from 1, zeros last
    rows = tiny.expand(1000, -1)
    assert set(categorical(rows, generator_uniforms(rows, g)).tolist()) == {0, 2}


def test_sampling_respects_top_k():
    logits = torch.zeros(1, 6)
    logits[0, 4] = 2.0
    logits[0, 2] = 1.9
    sampler = Sampler(0, "cpu")
    seen = {sampler(logits, info([SamplingParams(temperature=1.0, top_k=2)])).item() for _ in range(200)}
    assert seen == {2, 4}


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeded = SamplingParams(temperature=1.0, sampling_seed=42)
    a = Sampler(1, "cpu")(logits[:1], info([seeded], vocab=50, output_lens=[5]))
    b = Sampler(2, "cpu")(
        logits,
        info(
            [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)], vocab=50, output_lens=[5, 0, 3]
        ),
    )
    assert a[0] == b[0]
    draws = {Sampler(0, "cpu")(logits[:1], info([seeded], vocab=50, output_lens=[n])).item() for n in range(30)}
    assert len(draws) > 1, "the step index must vary the draw"


def test_seeded_uniforms_are_uniform_and_keyed():
    """The hashed uniforms have U(0, 1)'s mean and spread over steps, and differ by seed and
    by step (the same key: the same uniform)."""
    steps = torch.arange(20000)
    u = seeded_uniforms(torch.tensor([[7, 0]]).expand(20000, -1), steps).squeeze(1)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 12**-0.5) < 0.01
    keyed = seeded_uniforms(torch.tensor([[7, 0], [7, 0], [8, 0], [7, 1]]), torch.tensor([0, 1, 0, 0])).squeeze(1)
    assert len(set(keyed.tolist())) == 4
    assert keyed[0] == u[0]


def test_seeded_draws_follow_the_distribution():
    """Draws of one seeded request over many steps follow its probabilities."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    p = SamplingParams(temperature=1.0, sampling_seed=123)
    sampler = Sampler(0, "cpu")
    draws = torch.tensor([sampler(logits, info([p], vocab=3, output_lens=[n])).item() for n in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)


def test_unseeded_rows_follow_the_sampler_generator():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.0)] * 4
    a = [Sampler(5, "cpu")(logits, info(params, vocab=50)).tolist() for _ in range(2)]
    s = Sampler(5, "cpu")
    b = [s(logits, info(params, vocab=50)).tolist() for _ in range(2)]
    assert a[0] == a[1] == b[0] and b[0] != b[1]


def test_uniform_is_strictly_inside_0_1_in_float32():
    """The extreme bit patterns give float32 uniforms strictly inside (0, 1) (24 bits gave
    exactly 1.0 at the top)."""
    u = bits_to_uniform(torch.tensor([0, 0x1FF, 0xFFFFFE00, 0xFFFFFFFF], dtype=torch.int64))
    assert u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all(), u.tolist()


def test_a_filtered_token_is_never_drawn_at_the_extreme_uniforms():
    """Token 1 is removed by top-k, top-p or min-p, token 3 by all of them (the last token
    with p > 0 before the filters): the smallest and the largest uniform the hash gives, and
    uniforms at the kept tokens' edges, still draw a kept token."""
    logits = torch.tensor([[4.0, 0.0, 3.5, -1.0]])
    extremes = bits_to_uniform(torch.tensor([0, 0xFFFFFFFF], dtype=torch.int64))
    for extra in ({"top_k": 1}, {"top_p": 0.5}, {"min_p": 0.5}):
        probs = sampling_probs(logits, info([SamplingParams(temperature=1.0, **extra)], vocab=4))
        edges = (probs.cumsum(-1) / probs.sum()).flatten()
        for u in [*extremes.tolist(), *edges.tolist(), 1 - 2**-24]:
            token = categorical(probs, torch.tensor([[u]])).item()
            assert token in ({0} if "top_k" in extra or "top_p" in extra else {0, 2}), (extra, u)
