"""Tokenizers: a built-in byte-level one (no files, no downloads), Megatron's
``NullTokenizer`` semantics, and a local Hugging Face tokenizer when ``transformers`` is
installed.

Each exposes what Megatron-core's ``GPTDataset`` reads (``vocab_size``, ``eod``, ``pad``,
``unique_identifiers`` for its index-cache hash) and ``tokenize`` / ``detokenize`` for preprocessing.
"""

from __future__ import annotations

from typing import List, Optional, Sequence


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then ``<eod>`` = 256 and ``<pad>`` = 257 (vocab 258).

    The special tokens sit above the byte range, so no byte is ever mistaken for one.
    """

    NUM_BYTES = 256

    def __init__(self) -> None:
        self.eod = self.NUM_BYTES
        self.pad = self.NUM_BYTES + 1
        self.vocab_size = self.NUM_BYTES + 2
        self.unique_identifiers = {"class": "ByteTokenizer", "eod": self.eod, "pad": self.pad}

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def tokenize_bytes(self, data: bytes) -> List[int]:
        return list(data)

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron-LM's ``NullTokenizer``: text is space-separated ids; ``<eod>`` = vocab_size."""

    def __init__(self, vocab_size: int) -> None:
        self.eod = int(vocab_size)
        self.pad = -1
        self.vocab_size = int(vocab_size) + 1
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": self.vocab_size}

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer (``transformers.AutoTokenizer``); needs ``transformers``."""

    def __init__(self, model: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "--tokenizer-type HuggingFaceTokenizer needs the `transformers` package, which is not "
                "installed; use the built-in --tokenizer-type ByteTokenizer instead."
            ) from exc
        self._tok = AutoTokenizer.from_pretrained(model)
        self.vocab_size = len(self._tok)
        eod = self._tok.eos_token_id
        self.eod = int(eod) if eod is not None else self.vocab_size - 1
        self.pad = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else -1
        self.unique_identifiers = {"class": "HuggingFaceTokenizer", "model": model, "vocab_size": self.vocab_size}

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def build_tokenizer(tokenizer_type: str, vocab_size: Optional[int] = None, model: Optional[str] = None):
    """The tokenizer named by Megatron-LM's ``--tokenizer-type``."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a local directory or model name)")
        return HuggingFaceTokenizer(model)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron-LM's padding: the next multiple of ``divisible_by x TP``."""
    multiple = max(1, divisible_by) * tensor_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
