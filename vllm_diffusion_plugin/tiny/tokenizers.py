"""Tiny tokenizers built offline with the ``tokenizers`` library (no hub), for the runnable tiny pipelines.

Each comes from a small fixed word list or corpus and is the same in every process (vocabulary, merges, ids), and
is wrapped in transformers' own tokenizer class, so ``save_pretrained`` writes the files the real checkpoints ship
and the pipelines' ``from_pretrained`` reads them back: Qwen2's byte-level BPE (Qwen-Image; Qwen3's for Z-Image),
CLIP's BPE and T5's unigram (FLUX.1; T5's for Wan2.2's UMT5 too). Needs transformers and tokenizers.
"""

from __future__ import annotations

from collections.abc import Iterable

QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
"""Qwen2's special tokens (Qwen2.5-VL's text side, Qwen-Image), in the order of their ids (0, 1, ...) in the tiny
vocabulary."""
QWEN3_SPECIAL = (*QWEN2_SPECIAL, "<think>", "</think>")
"""Qwen3's (Z-Image's text encoder): Qwen2's and the think block's."""
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
"""The part of Qwen3's chat template that text-only, tool-free messages reach: ``<|im_start|>ROLE\\nTEXT<|im_end|>``
per message, the assistant turn opened by ``add_generation_prompt``, an empty think block when thinking is off
(what Z-Image's ``apply_chat_template(..., enable_thinking=True)`` gets from the real one)."""
TINY_CORPUS = ("a red cat walks on the beach", "a blue dog runs in the street", "a tiny image of the sky",
               "with slow motion and red and blue", "Describe the image by detailing the color, shape, size, "
               "texture, quantity, text, spatial relationships of the objects and background:",
               "system user assistant")


def qwen2_tokenizer(corpus: Iterable[str] = TINY_CORPUS, *, vocab_size: int = 400,
                    special: tuple[str, ...] = QWEN2_SPECIAL, chat_template: str | None = None):
    """A transformers ``Qwen2Tokenizer`` (Qwen2's byte-level BPE: its split regex, ``ByteLevel``, NFC) whose
    vocabulary and merges are trained on ``corpus`` -- every byte has a token, so any text tokenizes -- with the
    ``special`` tokens as single tokens and ``chat_template`` (if any) for ``apply_chat_template``. Qwen3's
    (Z-Image): ``special=QWEN3_SPECIAL, chat_template=QWEN3_CHAT_TEMPLATE``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(corpus), trainer)
    vocab, merges = _vocab_and_merges(bpe)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special[1:])})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def clip_tokenizer(words: Iterable[str]):
    """A byte-level BPE ``CLIPTokenizer`` (FLUX.1's first encoder): every byte alone and ending a word (``</w>``),
    and for each of ``words`` the merges that join it left to right into one token; 77 tokens long, as CLIP's.

    Built from the byte alphabet of ``tokenizers``' ``ByteLevel`` directly, not by its ``BpeTrainer``: the trainer
    breaks ties between equally frequent pairs in hash order, which gave another vocabulary in every process."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(
        ["<|startoftext|>", "<|endoftext|>", *alphabet, *(c + "</w>" for c in alphabet)])}
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = [*word[:-1], word[-1] + "</w>"]
        while len(pieces) > 1:
            pair, joined = (pieces[0], pieces[1]), pieces[0] + pieces[1]
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault(joined, len(vocab))
            pieces = [joined, *pieces[2:]]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer(words: Iterable[str]):
    """A unigram ``T5TokenizerFast`` (Wan2.2's UMT5 and FLUX.1's T5 encoders): one piece per word of ``words``
    (``\u2581word``), the letters and ``\u2581`` so anything else is spelled out, ``<pad>`` ``</s>`` ``<unk>``."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{w}", -1.0 - i / 10) for i, w in enumerate(words)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("\u2581", -6.0)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def _vocab_and_merges(bpe) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A trained ``tokenizers`` BPE's vocabulary and merges, as transformers' slow BPE tokenizers take them."""
    import json

    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
