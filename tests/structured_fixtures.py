"""A character-level tokenizer over the tiny models' 128 ids that can spell JSON (ids 0-2: pad, eos, bos; 3-97: the
printable ASCII characters; 98-127: frequent multi-character JSON pieces), for grammar-constrained tests."""

from __future__ import annotations

from typing import Any

PIECES = (
    '{"',
    '":',
    '",',
    '"}',
    '":"',
    '","',
    "true",
    "false",
    "null",
    "name",
    "type",
    "id",
    "{}",
    "[]",
    '["',
    '"]',
    "],",
    "},",
    "0.",
    "10",
    "00",
    "ing",
    "er",
    "on",
    "an",
    "en",
    "es",
    "or",
    "value",
    "items",
)


def char_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<|im_end|>": 1, "<s>": 2}
    for piece in chars + list(PIECES):
        vocab[piece] = len(vocab)
    assert len(vocab) == 128, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # encode: one id per character
    tok.decoder = decoders.Fuse()  # decode: pieces joined as is
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<s>", unk_token="<pad>"
    )
    out.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return out
