"""SGLang's speculative fields of `meta_info` and the /metrics acceptance gauges."""

from __future__ import annotations

from typing import Any


def spec_meta_info(verify_ct: int, draft_tokens: int, accepted_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A request's counts as SGLang reports them: its verify (decode) steps, drafts
    proposed and accepted, their ratio, and output tokens per verify step."""
    return {
        "spec_verify_ct": verify_ct,
        "spec_draft_token_num": draft_tokens,
        "spec_accept_token_num": accepted_tokens,
        "spec_accept_rate": accepted_tokens / draft_tokens if draft_tokens else 0.0,
        "spec_accept_length": completion_tokens / verify_ct if verify_ct else 1.0,
    }
