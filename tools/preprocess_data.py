#!/usr/bin/env python
"""Text or JSON lines -> a Megatron indexed dataset (``.bin`` / ``.idx``) for ``--data-path``.

Megatron-LM's ``tools/preprocess_data.py`` interface (``--input``, ``--json-keys``,
``--output-prefix``, ``--tokenizer-type``, ``--append-eod``; that script is not in the
megatron-core wheel), writing with Megatron-core's ``IndexedDatasetBuilder``. Output files
are ``{output_prefix}_{key}_document.bin/.idx``; train on them with
``--data-path {output_prefix}_{key}_document``::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/corpus --append-eod
    python tools/pretrain_gpt.py --recipe tiny_gqa --data-path data/corpus_text_document --split 90,8,2

Inputs: ``.jsonl`` / ``.json`` files hold one JSON object per line (one document per line,
text under each ``--json-keys`` key); any other file is plain text, one document per file,
or one per non-empty line with ``--split-lines``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from megatron_muon.megatron_lm.corpus import BYTE_VOCAB_SIZE, write_indexed_dataset


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and ``<eod>`` = 256: what ``--tokenizer-type NullTokenizer
    --vocab-size 257`` reads in ``pretrain_gpt.py`` (Megatron's NullTokenizer: eod = vocab - 1)."""

    vocab_size = BYTE_VOCAB_SIZE
    eod = BYTE_VOCAB_SIZE - 1

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer (needs ``transformers``); train with the same
    ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model``."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model)
        self.vocab_size = len(self._tok)
        self.eod = self._tok.eos_token_id if self._tok.eos_token_id is not None else self.vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


def build_tokenizer(kind: str, model: Optional[str]):
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if not model:
        raise SystemExit("preprocess_data.py: error: HuggingFaceTokenizer needs --tokenizer-model")
    return HuggingFaceTokenizer(model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--input", nargs="+", required=True, help="JSONL or text file(s)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys of the JSON objects to extract")
    parser.add_argument("--split-lines", action="store_true", help="text input: one document per non-empty line")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument(
        "--tokenizer-type",
        default="ByteTokenizer",
        choices=["ByteTokenizer", "HuggingFaceTokenizer"],
        help="ByteTokenizer: UTF-8 bytes, <eod> 256 (train with --tokenizer-type NullTokenizer "
        "--vocab-size 257, the default of pretrain_gpt.py)",
    )
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--append-eod", action="store_true", help="end every document with the <eod> token")
    parser.add_argument("--workers", type=int, default=1, help="accepted; tokenization runs in one process")
    parser.add_argument("--log-interval", type=int, default=10000)
    return parser


def _is_json(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json")


def iter_documents(paths: Sequence[str], keys: Sequence[str], split_lines: bool) -> Iterator[Dict[str, str]]:
    """``{key: text}`` per document, in input order."""
    for name in paths:
        path = Path(name)
        if _is_json(path):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{lineno}: not a JSON object: {exc}") from exc
                    missing = [k for k in keys if k not in obj]
                    if missing:
                        raise ValueError(f"{path}:{lineno}: no key(s) {missing} (use --json-keys)")
                    yield {k: str(obj[k]) for k in keys}
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if split_lines:
                for line in text.splitlines():
                    if line.strip():
                        yield {k: line for k in keys}
            else:
                yield {k: text for k in keys}


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def preprocess(args: argparse.Namespace) -> Dict[str, int]:
    """Write one indexed dataset per JSON key. Returns ``{prefix: number of documents}``."""
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    counts: Dict[str, int] = {}
    start = time.perf_counter()
    for key in args.json_keys:
        prefix = output_prefix(args.output_prefix, key)
        count = [0, 0]

        def documents() -> Iterator[List[int]]:
            for doc in iter_documents(args.input, [key], args.split_lines):
                ids = tokenizer.tokenize(doc[key])
                if args.append_eod:
                    ids.append(tokenizer.eod)
                if not ids:
                    continue
                count[0] += 1
                count[1] += len(ids)
                if count[0] % args.log_interval == 0:
                    print(f"processed {count[0]} documents ({count[1]} tokens)", flush=True)
                yield ids

        write_indexed_dataset(prefix, documents(), tokenizer.vocab_size)
        counts[prefix] = count[0]
        print(
            f"wrote {prefix}.bin/.idx: {count[0]} documents, {count[1]} tokens ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    preprocess(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
