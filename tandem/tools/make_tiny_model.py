"""Write a small Hugging Face causal-LM directory with seeded random weights.

Usage::

    python -m tandem.tools.make_tiny_model --arch llama|qwen2|qwen3 --out DIR \\
        [--preset tiny|tiny-mqa|gguf|7m|100m|wide] [--seed 0]

or :func:`make_tiny_model` from Python. The directory holds:

* ``config.json``, written by hand in the "old" flat form that vLLM, SGLang and
  transformers all accept (top-level ``rope_theta``, ``torch_dtype``);
* ``model.safetensors``, fp32, with the usual Hugging Face tensor names
  (Qwen2 adds q/k/v biases, Qwen3 per-head RMSNorm weights ``q_norm``/``k_norm``
  of size ``head_dim`` and no biases; both tie ``lm_head`` to the embedding, as
  the small released models do; Llama has a separate ``lm_head``), so that both
  the tied and untied cases are exercised;
* a BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` +
  ``special_tokens_map.json``, ChatML chat template) trained deterministically
  on the English text embedded below. Each arch gets the style of its real
  family, so both styles are exercised:

  - llama: SentencePiece/Llama-2 layout, ``"▁"`` for spaces, a dummy-prefix
    ``"▁"``, the 256 byte tokens ``<0x00>``..``<0xFF>`` (byte fallback), BOS
    prepended on encode. ``decode(encode(s)) == s`` for any string without a
    literal ``"▁"``. As in Llama-2's (legacy) tokenizer, text right after a
    special token also gets the dummy-prefix ``"▁"``.
  - qwen2, qwen3: Qwen2's byte-level BPE (NFC, Qwen2's split regex, the 256
    byte-level symbols), no BOS; the same tokenizer for both. This is the
    pipeline transformers' ``Qwen2Tokenizer`` rebuilds (``AutoTokenizer``
    forces that class for ``model_type`` qwen2; for qwen3 it reads
    ``tokenizer.json`` as is), so ``tokenizers`` and ``transformers`` agree;
    ``decode(encode(s)) == NFC(s)``.
* ``generation_config.json`` with the BOS/EOS ids.

The weights are drawn so that next-token distributions are *peaked* (logits
spread over several units), which keeps fp32 greedy decoding stable against
tiny numerical differences between two implementations of the same model.

Special-token ids are the same for every arch: 0 ``<unk>``, 1 ``<s>`` (BOS),
2 ``</s>`` (EOS), 3 ``<pad>``, 4 ``<|im_start|>``, 5 ``<|im_end|>``; then come the
256 byte tokens (ids 6..261) and the learned pieces. Vocabulary sizes: 1536
(llama), 1531 (qwen2 and qwen3, where the corpus runs out of merges); every
preset uses the same tokenizer. Presets (hidden/intermediate/layers/heads/kv
heads, head_dim = hidden/heads): tiny 64/172/3/4/2 (~0.3M params), tiny-mqa
64/172/3/4/1, gguf 512/768/2/4/2, 7m 256/768/8/8/4, 100m 768/2816/12/12/4,
wide 1024/4096/2/8/4 (~34M).

The ``gguf`` preset (~5M params) is for GGUF files: every dimension of every
2-D weight is a multiple of 256, so every GGUF block type (32-element blocks
and 256-element K-quant super-blocks) applies to every matrix, and head_dim is
128, the head size of the released Qwen3 models and the one transformers'
GGUF loader assumes for qwen3 (it reads no head size from a qwen3 file).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHS = ("llama", "qwen2", "qwen3")
SPACE = "\u2581"  # "▁", SentencePiece's visible space

UNK, BOS, EOS, PAD, IM_START, IM_END = "<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IM_START, IM_END)
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
VOCAB_SIZE = 1536  # specials + 256 byte tokens/symbols + learned pieces
# Qwen2's pre-tokenizer split (as in transformers' Qwen2Tokenizer).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Model shape; the vocabulary size comes from the trained tokenizer."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=64, intermediate_size=172, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    ),
    # One KV head (multi-query attention): tensor parallelism must replicate it.
    "tiny-mqa": Preset(
        hidden_size=64, intermediate_size=172, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1
    ),
    # GGUF files: every 2-D weight dimension a multiple of 256 (K-quant
    # super-blocks); head_dim 128 as in the released Qwen3 models.
    "gguf": Preset(
        hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "7m": Preset(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
    ),
    "100m": Preset(
        hidden_size=768, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4
    ),
    # Two layers whose gate/up, down and q/k/v weights hold 2 MB or more in Q8_0: the size from
    # which a decode step's threads take a weight's tiles in chunks (the C++ kernels' Share).
    "wide": Preset(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4
    ),
}

# Per-arch constants of the config (Qwen2/Qwen3 values follow the small released
# models: Qwen2-0.5B, Qwen3-0.6B tie their embeddings).
ARCH_SETTINGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        add_bos=True,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qkv_bias=True,
        qk_norm=False,
        add_bos=False,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=True,
        add_bos=False,
    ),
}

MAX_POSITION_EMBEDDINGS = 2048

# Init scales, chosen so that logits spread over several units (peaked
# distributions) while every layer still changes the residual stream.
EMBED_STD = 1.0
LINEAR_GAIN = 1.5
OUT_PROJ_GAIN = 2.0  # o_proj / down_proj, which write into the residual stream
LM_HEAD_GAIN = 4.0
BIAS_STD = 0.2
NORM_NOISE = 0.1

TRAINING_TEXT = """\
Once upon a time, in a small town by the sea, there lived an old baker named Tom.
Every morning he woke up at 4:30, lit the oven, and baked 12 loaves of bread, 36
rolls and a single round cake for whoever came first. The children loved him,
because he always kept a jar of honey cookies on the counter. "One each," he
would say, "and two on Sundays!"

The weather report said: rain on Monday, sun on Tuesday, and wind on Wednesday.
Temperatures will range from 12 to 19 degrees; bring a coat (and an umbrella).
In 2023 the town counted 8,450 people, 3 schools, 2 libraries and 1 lighthouse.
The lighthouse keeper, Mrs. Alvarez, had watched the harbor for 27 years.

A good scientist asks simple questions. Why is the sky blue? Why does ice float?
What happens to water when it boils at 100 degrees? Light from the sun is made of
many colors, and the air scatters blue light more than red light, so the sky looks
blue during the day and orange or red at sunset. Ice floats because water expands
when it freezes, which makes the solid lighter than the liquid around it.

The computer program reads a file, counts the words, and prints the ten most
common ones. First it opens the file; then it splits each line on spaces; finally
it sorts the counts from the largest to the smallest. If the file is empty, the
program prints nothing and returns 0. Errors are written to the log, not to the
screen, so that users are not confused by messages they cannot act on.

She walked through the forest, listening to the birds. The path was narrow and
covered with leaves, red and yellow and brown. A small rabbit jumped out of the
bushes, looked at her for a moment, and ran away. She smiled and kept walking
until she reached the river, where the water was cold, clear and very quiet.

History teaches us that cities grow near rivers, roads and ports. Merchants
traded salt, cloth, spices and metal; farmers brought grain, fruit and milk to
the market every week. Over the centuries, markets became towns, towns became
cities, and cities built walls, bridges, schools, hospitals and museums.

Recipe for pancakes: mix 2 cups of flour, 1 tablespoon of sugar, 2 teaspoons of
baking powder and a pinch of salt. In another bowl, whisk 2 eggs with 1.5 cups
of milk and 3 tablespoons of melted butter. Combine, stir gently, and cook on a
hot pan for about 2 minutes per side. Serve warm with fruit, syrup or jam.

The meeting starts at 9:15 a.m. sharp. Agenda: (1) review last quarter's
numbers; (2) plan the new product launch; (3) questions from the team. Please
read the report before you come, and send your comments by Friday at 5 p.m.
Our revenue grew by 14% this year, while costs went down by 3.2%.

Music is a language that everyone can understand. A melody can make us happy or
sad, calm or excited. Some people play the piano, others the guitar, the violin
or the drums; many simply sing in the shower. Children learn songs long before
they learn to read, and old people remember the songs of their youth.

"Where are you going?" asked the cat. "To the moon," said the little girl, "and
back before dinner." The cat thought about it for a while. "Then take me with
you," it said, "because I have never seen the moon up close, and I am curious."
They climbed the tallest tree in the garden and looked up at the bright sky.

Mathematics is full of patterns: 1, 2, 3, 5, 8, 13, 21, 34 are Fibonacci numbers;
2, 3, 5, 7, 11, 13, 17, 19 are primes; 1, 4, 9, 16, 25, 36 are squares. The sum
of the angles of a triangle is 180 degrees, and the area of a circle is pi times
the square of its radius. Numbers like 0.5, 3.14159 and -42 appear everywhere.

Good habits are built slowly. Sleep at least seven hours, drink enough water,
walk outside every day and read a few pages of a book before bed. Write down
what you want to learn this month, and check your list every Sunday evening.
Small steps, repeated many times, lead to large changes over the years.

The train left the station at noon. Through the window, fields and villages
passed by: green hills, white houses, a church with a tall tower, a farmer on a
tractor, cows resting in the shade of an oak tree. The passengers read, talked,
slept or simply watched the world go by, while the conductor checked tickets.

Dear Sam, thank you for your letter. We are all well here, although the winter
has been long and cold. The garden is covered with snow, and the birds come to
the window every morning looking for seeds. I hope to visit you in the spring,
when the roads are open again. With love, Anna. P.S. Say hello to your sister!

Questions & answers: Is it safe? Yes. Is it fast? Usually. Does it work offline?
Only partly - some features need a network. How much does it cost? $19.99 per
month, or $199 per year. Can I cancel? Of course; just click "Cancel" in the
settings page, and the plan stops at the end of the current period.

The engineers tested the bridge for weeks. Heavy trucks drove across it, sensors
measured every small movement, and computers compared the data with the models.
When all the tests passed, the mayor cut a ribbon, the band played, and the
first cars crossed the river while people cheered and waved from the sidewalks.

Language models read text as tokens: short pieces of words, single letters, or
even raw bytes. A tokenizer splits the input, the model predicts the next token,
and the decoder turns the tokens back into text. Spaces, punctuation, digits and
new lines all matter, because a single missing space changes the meaning.
"""


def _training_lines() -> list[str]:
    """Corpus used to train the tokenizer: the embedded prose plus digit and punctuation drills."""
    lines = [line for line in TRAINING_TEXT.splitlines() if line.strip()]
    lines.append(" ".join(str(n) for n in range(200)))
    lines.append("! ? . , ; : ' \" ( ) [ ] { } < > / \\ | - _ + = * & % $ # @ ^ ~ `")
    return lines


def _train(tokenizer: Tokenizer, vocab_size: int, initial_alphabet: list[str]) -> None:
    """Train ``tokenizer``'s BPE model in place on the embedded corpus (deterministic)."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=initial_alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(), trainer=trainer)


def _train_metaspace_pieces() -> Tokenizer:
    """Train a plain BPE (no byte tokens yet) over "▁"-prefixed words."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=True)
    _train(tokenizer, VOCAB_SIZE - len(BYTE_TOKENS), [])
    return tokenizer


def _byte_fallback_model(base: Tokenizer) -> models.BPE:
    """Re-number the trained vocab as specials, 256 byte tokens, then learned pieces."""
    state = json.loads(base.to_str())["model"]
    learned = sorted(
        (piece for piece in state["vocab"] if piece not in SPECIAL_TOKENS),
        key=lambda piece: state["vocab"][piece],
    )
    ordered = list(SPECIAL_TOKENS) + list(BYTE_TOKENS) + [p for p in learned if p not in BYTE_TOKENS]
    vocab = {piece: i for i, piece in enumerate(ordered)}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    return models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=False)


def build_sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2-style byte-fallback BPE that prepends BOS.

    Spaces become ``"▁"``, a ``"▁"`` is prepended to non-empty input (the
    SentencePiece dummy prefix) and stripped again by the decoder, and
    characters outside the vocabulary become ``<0xXX>`` byte tokens, so
    ``decode(encode(s)) == s`` for every string without a literal ``"▁"``.
    """
    tokenizer = Tokenizer(_byte_fallback_model(_train_metaspace_pieces()))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    # Split before each "▁" (keeping it with the following word) so that BPE runs
    # on words rather than whole documents; this cannot change the result
    # because no learned piece has a "▁" past its first character.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(SPACE), behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_bytelevel_tokenizer() -> Tokenizer:
    """Qwen2-style byte-level BPE (NFC, Qwen2's split regex, no BOS).

    This is exactly the pipeline that transformers' ``Qwen2Tokenizer`` rebuilds
    from ``tokenizer.json`` (``AutoTokenizer`` forces that class for
    ``model_type`` qwen2), so ``tokenizers`` and ``transformers`` agree.
    ``decode(encode(s)) == unicodedata.normalize("NFC", s)`` for every string.
    """
    tokenizer = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _train(tokenizer, VOCAB_SIZE, pre_tokenizers.ByteLevel.alphabet())
    return tokenizer


def build_tokenizer(arch: str) -> Tokenizer:
    """The tokenizer for ``arch``: SentencePiece-style for llama, byte-level for qwen2 and qwen3."""
    return build_sentencepiece_tokenizer() if arch == "llama" else build_bytelevel_tokenizer()


def _init_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def _linear(out_features: int, in_features: int, gain: float, generator: torch.Generator) -> torch.Tensor:
    return _normal((out_features, in_features), gain / math.sqrt(in_features), generator)


def _norm(size: int, generator: torch.Generator) -> torch.Tensor:
    return 1.0 + _normal((size,), NORM_NOISE, generator)


def make_weights(preset: Preset, vocab_size: int, arch: str, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights under Hugging Face Llama/Qwen2/Qwen3 tensor names."""
    settings = ARCH_SETTINGS[arch]
    g = _init_generator(seed)
    h, inter, hd = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q_out, kv_out = preset.num_attention_heads * hd, preset.num_key_value_heads * hd
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal((vocab_size, h), EMBED_STD, g)}
    for layer in range(preset.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = _norm(h, g)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            tensors[p + f"self_attn.{name}.weight"] = _linear(out, h, LINEAR_GAIN, g)
            if settings["qkv_bias"]:
                tensors[p + f"self_attn.{name}.bias"] = _normal((out,), BIAS_STD, g)
        if settings["qk_norm"]:  # Qwen3: one RMSNorm weight of head_dim, shared by all heads
            tensors[p + "self_attn.q_norm.weight"] = _norm(hd, g)
            tensors[p + "self_attn.k_norm.weight"] = _norm(hd, g)
        tensors[p + "self_attn.o_proj.weight"] = _linear(h, q_out, OUT_PROJ_GAIN, g)
        tensors[p + "post_attention_layernorm.weight"] = _norm(h, g)
        tensors[p + "mlp.gate_proj.weight"] = _linear(inter, h, LINEAR_GAIN, g)
        tensors[p + "mlp.up_proj.weight"] = _linear(inter, h, LINEAR_GAIN, g)
        tensors[p + "mlp.down_proj.weight"] = _linear(h, inter, OUT_PROJ_GAIN, g)
    tensors["model.norm.weight"] = _norm(h, g)
    if settings["tie_word_embeddings"]:
        # The tied matrix doubles as lm_head: scale it for peaked logits
        # (the input side does not care, RMSNorm follows it).
        tensors["model.embed_tokens.weight"] *= LM_HEAD_GAIN / math.sqrt(h)
    else:
        tensors["lm_head.weight"] = _linear(vocab_size, h, LM_HEAD_GAIN, g)
    return tensors


def make_config(preset: Preset, vocab_size: int, arch: str, bos_id: int, eos_id: int) -> dict:
    """The flat ("old" form) config.json contents."""
    settings = ARCH_SETTINGS[arch]
    config = {
        "architectures": settings["architectures"],
        "model_type": arch,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": settings["rms_norm_eps"],
        "rope_theta": settings["rope_theta"],
        "rope_scaling": None,
        "tie_word_embeddings": settings["tie_word_embeddings"],
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=preset.num_hidden_layers)
        if arch == "qwen3":
            config.update(attention_bias=False)
    return config


def added_tokens_decoder(specials: Iterable[tuple[int, str]]) -> dict:
    """The `added_tokens_decoder` entry of tokenizer_config.json for special tokens."""
    return {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in specials
    }


def tokenizer_config(tokenizer: Tokenizer, add_bos: bool) -> dict:
    """tokenizer_config.json contents for ``PreTrainedTokenizerFast``."""
    added = added_tokens_decoder((tokenizer.token_to_id(tok), tok) for tok in SPECIAL_TOKENS)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHATML_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(out_dir: str | Path, arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight ``arch`` model of size ``preset`` into ``out_dir``; return its path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings, shape = ARCH_SETTINGS[arch], PRESETS[preset]

    tokenizer = build_tokenizer(arch)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)

    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, settings["add_bos"]))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    _write_json(out / "config.json", make_config(shape, vocab_size, arch, bos_id, eos_id))
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    weights = make_weights(shape, vocab_size, arch, seed)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out, arch=args.arch, preset=args.preset, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
