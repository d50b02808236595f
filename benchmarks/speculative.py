"""Speculative decoding (#28) on one stream: tokens per second and acceptance length,
with and without `--speculative-algorithm`, side by side in one run.

    .venv/bin/python benchmarks/speculative.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--repeats 3] [--max-new-tokens 160] [--configs off,ngram,ngram8,ngram-w1]

Two workloads, each a chat prompt sent alone, greedy, through the offline Engine:
  repeat  the model is asked to copy a given paragraph and then a given function (its
          output repeats its input: where n-gram drafts are accepted);
  fresh   the model writes new text (a story, an explanation): few drafts match.
One Engine per configuration, all started first; every request then runs on each
configuration in turn (interleaved, so a noisy machine slows all alike). Reported per
workload and configuration: decode tokens per second (output tokens after the first over
the time after the first token; median over requests and --repeats) and SGLang's
spec_accept_length (output tokens per decode step; mean). STANDALONE needs a draft
model with the target's tokenizer, which this repository does not ship for the default
model: `--draft-model-path` adds a `standalone` configuration.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from tandem.entrypoints.engine import Engine
from tandem.utils.tokenizer import load_tokenizer

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wound the clockwork that turned the light. Ships "
    "far out at sea watched for its steady pulse, and the keeper wrote each night in his log book."
)
FUNCTION = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n"
)
WORKLOADS = {
    "repeat": [
        f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
        f"Copy this Python function exactly, then stop:\n\n{FUNCTION}",
    ],
    "fresh": [
        "Write a short story about a robot who learns to paint.",
        "Explain how rain forms, in a few paragraphs.",
    ],
}
CONFIGS = {
    "off": {},
    "ngram": {"speculative_algorithm": "NGRAM"},
    "ngram8": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8},
    "ngram-w1": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1},
}


def run_one(engine: Engine, input_ids: list[int], max_new_tokens: int) -> tuple[float, float, int]:
    """(decode tokens/s, acceptance length, output tokens) of one streamed request."""
    first = last = None
    meta = {}
    for chunk in engine.generate(
        input_ids=input_ids, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens}, stream=True
    ):
        now = time.perf_counter()
        first = first or now
        last, meta = now, chunk["meta_info"]
    tokens = meta["completion_tokens"]
    rate = (tokens - 1) / (last - first) if last > first else 0.0
    return rate, float(meta.get("spec_accept_length", 1.0)), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--draft-model-path", default=None)
    args = parser.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    if args.draft_model_path:
        configs["standalone"] = {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": args.draft_model_path,
        }
    tokenizer = load_tokenizer(args.model)

    def chat(text: str) -> list[int]:
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(templated, add_special_tokens=False)

    prompts = {name: [chat(p) for p in ps] for name, ps in WORKLOADS.items()}
    engines = {
        name: Engine(model_path=args.model, random_seed=0, max_total_tokens=4096, **flags)
        for name, flags in configs.items()
    }
    rates: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    lengths: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    try:
        for engine in engines.values():
            run_one(engine, prompts["fresh"][0], 8)  # warm-up
        # Interleaved: each request runs on every configuration in turn, so the machine's
        # noise falls on all of them alike.
        for _ in range(args.repeats):
            for workload, ids_list in prompts.items():
                for ids in ids_list:
                    for name, engine in engines.items():
                        rate, length, _ = run_one(engine, ids, args.max_new_tokens)
                        rates[workload, name].append(rate)
                        lengths[workload, name].append(length)
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = [
        (workload, name, statistics.median(rates[workload, name]), statistics.mean(lengths[workload, name]))
        for workload in prompts
        for name in engines
    ]
    base = {w: r for w, n, r, _ in rows if n == "off"}
    print("\n| workload | config | decode tok/s | vs off | spec_accept_length |")
    print("|---|---|---:|---:|---:|")
    for workload, name, rate, length in rows:
        ratio = f"{rate / base[workload]:.2f}x" if workload in base else "-"
        print(f"| {workload} | {name} | {rate:.1f} | {ratio} | {length:.2f} |")


if __name__ == "__main__":
    main()
