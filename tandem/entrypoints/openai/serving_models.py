"""GET /v1/models, GET /v1/models/{id}, and the tokenizer utilities POST /tokenize and
POST /detokenize."""

from __future__ import annotations

from tandem.entrypoints.openai.common import served_model_names
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest


def model_card(server_args, context_len: int | None) -> ModelCard:
    return ModelCard(id=server_args.served_model_name, root=server_args.model_path, max_model_len=context_len)


def list_models(server_args, context_len: int | None) -> ModelList:
    return ModelList(data=[model_card(server_args, context_len)])


def retrieve_model(model_id: str, server_args, context_len: int | None) -> ModelCard:
    """The served model's card; 404 `model_not_found` for any other id."""
    if model_id not in served_model_names(server_args):
        raise OpenAIError(f"model: the model {model_id!r} does not exist", 404, param="model", code="model_not_found")
    return model_card(server_args, context_len)


def _require_tokenizer(tokenizer, param: str) -> None:
    if tokenizer is None:
        raise OpenAIError(f"{param}: this server runs without a tokenizer (--skip-tokenizer-init)", 400, param=param)


def tokenize(req: TokenizeRequest, tokenizer, context_len: int) -> dict:
    """{"tokens", "count", "max_model_len"} for `text` (or `prompt`)."""
    if (req.text is None) == (req.prompt is None):
        raise OpenAIError("text: exactly one of text and prompt must be given", 400, param="text")
    _require_tokenizer(tokenizer, "text")
    ids = tokenizer.encode(req.text if req.text is not None else req.prompt,
                           add_special_tokens=req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": context_len}


def detokenize(req: DetokenizeRequest, tokenizer, vocab_size: int | None) -> dict:
    """{"text"} for the token ids `tokens`."""
    _require_tokenizer(tokenizer, "tokens")
    if vocab_size is not None:
        bad = [t for t in req.tokens if t >= vocab_size]
        if bad:
            raise OpenAIError(f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab_size})",
                              400, param="tokens")
    return {"text": tokenizer.decode(req.tokens)}
