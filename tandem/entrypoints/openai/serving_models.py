"""GET /v1/models, GET /v1/models/{id}, and the tokenizer utilities POST /tokenize and
POST /detokenize."""

from __future__ import annotations

from tandem.entrypoints.openai.common import served_model_names
from tandem.entrypoints.openai.errors import OpenAIError, from_value_error
from tandem.entrypoints.openai.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from tandem.tokenizer.text_encoder import TextEncoder


def model_card(server_args, context_len: int | None, gguf: dict | None = None) -> ModelCard:
    return ModelCard(
        id=server_args.served_model_name, root=server_args.model_path, max_model_len=context_len, gguf=gguf
    )


def adapter_cards(server_args, context_len: int | None, adapters: dict[str, str]) -> list[ModelCard]:
    """One card per loaded LoRA adapter (name -> path), its parent the served model (as SGLang)."""
    parent = server_args.served_model_name
    return [ModelCard(id=n, root=p, parent=parent, max_model_len=context_len) for n, p in adapters.items()]


def list_models(
    server_args, context_len: int | None, gguf: dict | None = None, adapters: dict[str, str] | None = None
) -> ModelList:
    """The served model, then its loaded LoRA adapters."""
    return ModelList(
        data=[model_card(server_args, context_len, gguf), *adapter_cards(server_args, context_len, adapters or {})]
    )


def retrieve_model(
    model_id: str,
    server_args,
    context_len: int | None,
    gguf: dict | None = None,
    adapters: dict[str, str] | None = None,
) -> ModelCard:
    """The served model's card, or a loaded adapter's; 404 `model_not_found` for any other id."""
    if model_id in served_model_names(server_args):
        return model_card(server_args, context_len, gguf)
    if model_id in (adapters or {}):
        return adapter_cards(server_args, context_len, {model_id: adapters[model_id]})[0]
    raise OpenAIError(f"model: the model {model_id!r} does not exist", 404, param="model")


def _require_tokenizer(encoder: TextEncoder | None, param: str) -> None:
    if encoder is None:
        raise OpenAIError(f"{param}: this server runs without a tokenizer (--skip-tokenizer-init)", 400, param=param)


async def tokenize(req: TokenizeRequest, encoder: TextEncoder | None, context_len: int, chat) -> dict:
    """SGLang's {"tokens", "count", "max_model_len"} for `prompt` (or Tandem's alias `text`):
    one list and count for a string, a list of each for a list of strings; for `messages`,
    the ids `chat` (the ChatServing) would prompt the model with."""
    if sum(f is not None for f in (req.prompt, req.text, req.messages)) != 1:
        raise OpenAIError("Exactly one of 'prompt' or 'messages' must be provided.", 400, param="prompt")
    if req.messages is not None:
        ids, _ = await chat.prompt_ids(req.to_chat_request())
        return {"tokens": ids, "count": len(ids), "max_model_len": context_len}
    _require_tokenizer(encoder, "prompt")
    field = "text" if req.text is not None else "prompt"
    prompt = req.text if req.text is not None else req.prompt
    try:
        batch = [
            await encoder.encode(p, field, add_special_tokens=req.add_special_tokens)
            for p in ([prompt] if isinstance(prompt, str) else prompt)
        ]
    except ValueError as e:
        raise from_value_error(e) from e
    if isinstance(prompt, str):
        return {"tokens": batch[0], "count": len(batch[0]), "max_model_len": context_len}
    return {"tokens": batch, "count": [len(ids) for ids in batch], "max_model_len": context_len}


async def detokenize(req: DetokenizeRequest, encoder: TextEncoder | None, vocab_size: int | None) -> dict:
    """{"text"} for the token ids `tokens` (a list of texts for a list of id lists), without
    special tokens unless `skip_special_tokens` is false."""
    _require_tokenizer(encoder, "tokens")
    is_batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    batch = req.tokens if is_batch else [req.tokens]
    if vocab_size is not None:
        bad = [t for ids in batch for t in ids if t >= vocab_size]
        if bad:
            raise OpenAIError(
                f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab_size})", 400, param="tokens"
            )
    texts = [await encoder.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in batch]
    return {"text": texts if is_batch else texts[0]}
