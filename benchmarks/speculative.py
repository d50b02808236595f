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
model: `--draft-model-path` adds a `standalone` configuration. `--doc docs/benchmarks.md`
writes the run's section of that page (command, machine, commit, load, the table, a reading).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

from tandem.benchmarks import report
from tandem.entrypoints.engine import Engine
from tandem.utils.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "benchmarks/speculative.py"

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
CONFIG_LABELS = {
    "off": "off",
    "ngram": "NGRAM (defaults: 4 tokens a verify, match window 3..12)",
    "ngram8": "NGRAM, 8 tokens a verify",
    "ngram-w1": "NGRAM, match window 1..12",
    "standalone": "STANDALONE (--draft-model-path)",
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


def render_doc(rows: list[tuple[str, str, float, float]], args, command: str, started: float, load0: float) -> str:
    """The run's section of docs/benchmarks.md: tokens/s and acceptance length per workload
    and configuration, against off, and a reading."""
    n = {w: len(ps) for w, ps in WORKLOADS.items()}
    body = [
        f"Model `{args.model}` (default flags), one stream through the offline Engine, greedy, at most "
        f"{args.max_new_tokens} new tokens. Workloads: repeat = {n['repeat']} chat prompts asking the model to "
        f"copy a given paragraph / function (its output repeats its input); fresh = {n['fresh']} asking for new "
        "text (a story, an explanation). One Engine per configuration, every request run on each in turn "
        f"(interleaved), {args.repeats} times. Decode tok/s = output tokens after the first over the time "
        "after the first token, the median over requests and repeats; spec_accept_length = output tokens "
        "per decode step (the mean; 1 without speculation).",
        "",
        "| workload | configuration | decode tok/s | vs off | spec_accept_length |",
        "|---|---|---:|---:|---:|",
    ]
    base = {w: r for w, name, r, _ in rows if name == "off"}
    for workload, name, rate, length in rows:
        ratio = f"**{rate / base[workload]:.2f}x**" if base.get(workload) else "-"
        body.append(f"| {workload} | {CONFIG_LABELS.get(name, name)} | {rate:.1f} | {ratio} | {length:.2f} |")
    spec = [(w, name, r / base[w], length) for w, name, r, length in rows if name != "off" and base.get(w)]
    reading = ""
    if spec:
        by = {(w, name): (ratio, length) for w, name, ratio, length in spec}
        parts = [
            f"{by[w, 'ngram'][1]:.2f} tokens a decode step on {what}, at {by[w, 'ngram'][0]:.2f}x of off's tokens/s"
            for w, what in (("repeat", "the repeating workload"), ("fresh", "fresh text"))
            if (w, "ngram") in by
        ]
        if parts:
            reading = "With its defaults NGRAM averages " + ", and ".join(parts) + ". "
        rep = [(ratio, length) for w, _, ratio, length in spec if w == "repeat"]
        if rep and max(rep)[0] < 1.1:
            reading += (
                f"Speculation is not faster on this CPU: the best repeating-workload row is {max(rep)[0]:.2f}x of "
                f"off at {max(rep)[1]:.2f} tokens a step, since a verify forward of several tokens costs about as "
                "much as the decode steps it saves (docs/perf-log/speculative.md)."
            )
        elif ("repeat", "ngram") in by:
            ratio, length = by["repeat", "ngram"]
            reading += (
                f"It pays on the repeating workload only, and far less than the {length:.2f} tokens a step would "
                f"give with a free verify: a verify forward costs about {length / ratio:.1f} decode steps here "
                "(tokens a step / speed-up; docs/perf-log/speculative.md)."
            )
        fresh = [(ratio, length) for w, _, ratio, length in spec if w == "fresh"]
        if fresh and all(abs(ratio - 1) < 0.1 for ratio, _ in fresh):
            reading += " On fresh text every configuration is within 10% of off: no gain, and no loss beyond noise."
        if any(ratio > 1.1 and length < 1.6 for ratio, length in fresh):
            reading += (
                " Fresh-text rows above 1x with fewer than 1.6 tokens a step are more than such acceptance can buy "
                "at these verify costs: read them as the machine's noise."
            )
    body += ["", reading.strip()]
    return report.render_section(
        SCRIPT,
        "Speculative decoding: one stream, repeating against fresh text, with and without NGRAM (#28)",
        command,
        started,
        (load0, os.getloadavg()[0]),
        body,
        report.git_rev(REPO, ignore=(Path(args.doc),)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--draft-model-path", default=None)
    parser.add_argument("--doc", default=None, help="write this run's section of this markdown page")
    args = parser.parse_args()
    started, load0 = time.time(), os.getloadavg()[0]
    command = report.command_line(SCRIPT, sys.argv[1:])
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
    if args.doc:
        section = render_doc(rows, args, command, started, load0)
        print(f"[speculative] {args.doc}: {report.splice_section(Path(args.doc), SCRIPT, section)}", flush=True)


if __name__ == "__main__":
    main()
