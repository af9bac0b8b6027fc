"""Tiny tokenizers built offline with the ``tokenizers`` library (no hub), for the runnable tiny pipelines.

Each is trained on a small fixed corpus (deterministic: the same vocabulary and merges every time) and wrapped in
transformers' own tokenizer class, so ``save_pretrained`` writes the files the real checkpoints ship and the
pipelines' ``from_pretrained`` reads them back. Needs transformers and tokenizers.
"""

from __future__ import annotations

from collections.abc import Iterable

QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
"""Qwen2's special tokens, in the order of their ids (0, 1, ...) in the tiny vocabulary."""
TINY_CORPUS = ("a red cat walks on the beach", "a blue dog runs in the street", "a tiny image of the sky",
               "with slow motion and red and blue", "Describe the image by detailing the color, shape, size, "
               "texture, quantity, text, spatial relationships of the objects and background:",
               "system user assistant")


def qwen2_tokenizer(corpus: Iterable[str] = TINY_CORPUS, *, vocab_size: int = 400):
    """A transformers ``Qwen2Tokenizer`` (Qwen2's byte-level BPE: its split regex, ``ByteLevel``, NFC) whose
    vocabulary and merges are trained on ``corpus`` -- every byte has a token, so any text tokenizes -- with
    Qwen2's special tokens (``QWEN2_SPECIAL``) as single tokens."""
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN2_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(corpus), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_SPECIAL[1:])})
    return tokenizer
