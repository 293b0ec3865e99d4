"""A byte-level tokenizer for the models we train: every byte is a token (so every text,
digits and Jane Austen alike, is representable), plus a few special tokens.

Ids 0-255 are bytes; then the specials, in this order."""

from __future__ import annotations

from typing import Any

SPECIALS = ("<|endoftext|>", "<|bos|>", "<|mask|>", "<|pad|>")
EOS_ID, BOS_ID, MASK_ID, PAD_ID = 256, 257, 258, 259


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def byte_tokenizer() -> Any:
    """A transformers fast tokenizer (saves as tokenizer.json) with ids as documented above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _gpt2_bytes()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIALS[0],
        bos_token=SPECIALS[1],
        mask_token=SPECIALS[2],
        pad_token=SPECIALS[3],
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def encode(text: str) -> list[int]:
    """Byte ids of a text (no specials): the same ids the tokenizer produces, without it."""
    return list(text.encode("utf-8"))
