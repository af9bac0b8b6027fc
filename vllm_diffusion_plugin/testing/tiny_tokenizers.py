"""Tiny tokenizers built offline with the ``tokenizers`` library (no hub), for the runnable tiny pipelines.

Each is trained on a small fixed corpus (deterministic: the same vocabulary and merges every time) and wrapped in
transformers' own tokenizer class, so ``save_pretrained`` writes the files the real checkpoints ship and the
pipelines' ``from_pretrained`` reads them back. Needs transformers and tokenizers.
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
    import json

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
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special[1:])})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
