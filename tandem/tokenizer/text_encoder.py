"""Tokenizing prompts off the event loop, with the checks that come before it.

One worker thread runs the tokenizer (the Rust tokenizer releases the GIL while it
encodes, so the HTTP event loop keeps answering meanwhile; one thread, because a fast
tokenizer must not be entered from two threads at once). Before a text is tokenized it
is refused, with a ValueError naming the request field, when it holds a lone surrogate
or is so long in characters that it can never fit the token budget
(`max_chars_per_token`): tokenizing megabytes only to refuse them is avoided.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from tandem.utils.tokenizer import LONE_SURROGATE, max_chars_per_token


class TextEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer")

    async def encode(
        self, text: str, field: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """The token ids of `text`, computed on the tokenizer thread.

        With `max_tokens`, a text longer than `max_tokens` x the most characters one
        token covers is refused before tokenizing (it would have more tokens).
        """
        bound = self.max_chars_per_token
        if max_tokens is not None and bound is not None and len(text) > max_tokens * bound:
            raise ValueError(
                f"{field}: the prompt is {len(text)} characters long, so more than {max_tokens} "
                f"tokens (no token covers more than {bound} characters): it cannot fit the "
                "context length"
            )
        encode = functools.partial(self._encode, text, field, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._executor, encode)

    def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        match = LONE_SURROGATE.search(text)
        if match is not None:
            raise ValueError(
                f"{field}: contains a lone surrogate {ascii(match.group())} at character "
                f"{match.start()}, which is not valid Unicode"
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`, decoded on the tokenizer thread."""
        decode = functools.partial(self.tokenizer.decode, ids, skip_special_tokens=skip_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._executor, decode)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
