"""`--speculative-*` flags (SGLang's names): their CLI, defaults and start-up checks."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.server_args import ServerArgs

ALGORITHMS = ("NGRAM", "STANDALONE")
# SGLang's other algorithms, named in the start error.
NOT_BUILT = ("EAGLE", "EAGLE3", "NEXTN", "LOOKAHEAD")
# Tokens per request in an NGRAM verify forward (newest token + drafts): measured on the
# default model (docs/perf-log/speculative.md).
NGRAM_DEFAULT_DRAFT_TOKENS = 4
NGRAM_DEFAULT_MIN_WINDOW = 3
# SGLang's default for a STANDALONE draft model.
STANDALONE_DEFAULT_STEPS = 3


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Speculative decoding", "SGLang's flags; see docs/api.md")
    group.add_argument(
        "--speculative-algorithm",
        default=None,
        help="NGRAM: drafts from the request's own prompt and output (suffix match); STANDALONE: a "
        "small draft model with the same tokenizer (--speculative-draft-model-path). Runs the normal loop.",
    )
    group.add_argument("--speculative-draft-model-path", default=None, help="STANDALONE's draft model.")
    group.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help=f"STANDALONE: draft tokens proposed per step (default {STANDALONE_DEFAULT_STEPS}).",
    )
    group.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="Tokens per request in a verify forward, the newest token included (NGRAM default "
        f"{NGRAM_DEFAULT_DRAFT_TOKENS}; STANDALONE: --speculative-num-steps + 1).",
    )
    group.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=NGRAM_DEFAULT_MIN_WINDOW,
        help="NGRAM: the shortest suffix of the sequence that is looked up.",
    )
    group.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=12,
        help="NGRAM: the longest suffix of the sequence that is looked up (tried first).",
    )


def resolve_speculative_args(args: ServerArgs) -> None:
    """Fill the defaults and check the flags (ValueError naming the flag)."""
    algo = args.speculative_algorithm
    if algo is None:
        if args.speculative_draft_model_path is not None:
            raise ValueError("--speculative-draft-model-path: needs --speculative-algorithm STANDALONE")
        return
    if algo not in ALGORITHMS:
        built = " and ".join(ALGORITHMS)
        what = "is not built" if algo in NOT_BUILT else "is unknown"
        raise ValueError(f"--speculative-algorithm {algo}: {what} (the algorithms built are {built})")
    if args.disable_overlap_schedule is False:
        raise ValueError("--speculative-algorithm: runs the normal loop only (the overlap loop is not built for it)")
    if args.tp_size > 1 or args.dp_size > 1:
        raise ValueError("--speculative-algorithm: not built with --tp-size or --dp-size > 1")
    if algo == "NGRAM":
        if args.speculative_draft_model_path is not None:
            raise ValueError("--speculative-draft-model-path: only with --speculative-algorithm STANDALONE")
        args.speculative_num_draft_tokens = args.speculative_num_draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
        low, high = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "--speculative-ngram-min-match-window-size / --speculative-ngram-max-match-window-size: "
                f"need 1 <= min <= max (got {low}, {high})"
            )
    else:
        if args.speculative_draft_model_path is None:
            raise ValueError("--speculative-algorithm STANDALONE: needs --speculative-draft-model-path")
        steps = args.speculative_num_steps or STANDALONE_DEFAULT_STEPS
        if args.speculative_num_draft_tokens not in (None, steps + 1):
            raise ValueError(
                f"--speculative-num-draft-tokens {args.speculative_num_draft_tokens}: STANDALONE verifies a chain "
                f"of --speculative-num-steps + 1 = {steps + 1} tokens"
            )
        args.speculative_num_steps, args.speculative_num_draft_tokens = steps, steps + 1
        check_draft_model(args)
    if args.speculative_num_draft_tokens < 2:
        raise ValueError(
            f"--speculative-num-draft-tokens {args.speculative_num_draft_tokens}: must be >= 2 (the newest "
            "token and at least one draft)"
        )


def check_draft_model(args: ServerArgs) -> None:
    """The draft model must share the target's vocabulary and tokenizer: its token ids are
    the target's."""
    from tandem.model_executor.model_loader import load_config
    from tandem.utils.tokenizer import load_tokenizer

    flag = f"--speculative-draft-model-path {args.speculative_draft_model_path}"
    try:
        draft_config = load_config(args.speculative_draft_model_path)
    except Exception as e:  # noqa: BLE001 - the start error names the flag
        raise ValueError(f"{flag}: cannot be loaded ({type(e).__name__}: {e})") from None
    target_vocab, draft_vocab = load_config(args.model_path).vocab_size, draft_config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"{flag}: its vocabulary ({draft_vocab} tokens) differs from the target model's ({target_vocab})"
        )
    if args.skip_tokenizer_init:
        return
    target_tok, draft_tok = load_tokenizer(args.tokenizer_path), load_tokenizer(args.speculative_draft_model_path)
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"{flag}: its tokenizer differs from the target model's (other token ids)")
