"""The built-in corpus (no download) and the data checks Megatron-LM lacks.

With no data named (neither ``--data-path``, per-split paths nor ``--mock-data``), the
training data is this Python's standard-library source: one document per file, as byte ids
0..255 ended by ``<eod>`` = 256, which Megatron-LM's own ``NullTokenizer`` with
``--vocab-size 257`` reads. It is written once with Megatron-core's ``IndexedDatasetBuilder``
under ``--data-cache-path`` (else ``$MEGATRON_MUON_CACHE``, else ``~/.cache/megatron_muon``)
and then read exactly as ``--data-path`` would be.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

import numpy as np
import torch

STDLIB_PREFIX = "stdlib_text_document"
BYTE_VOCAB_SIZE = 257
"""Bytes 0..255 and ``<eod>`` 256 (``NullTokenizer``: eod = vocab_size - 1)."""
SPLITS = ("train", "validation", "test")
STDLIB_SPLIT = "98,2,0"
"""The built-in corpus's ``--split`` unless one is given: the last 2% of files validate."""


class CorpusError(ValueError):
    """The data cannot give what the run asks for; the message says how to fix it."""


def uses_builtin_corpus(args: argparse.Namespace) -> bool:
    return not (
        args.mock_data
        or args.data_path
        or args.train_data_path
        or args.data_args_path
        or getattr(args, "per_split_data_args_path", None)
    )


def check_tokenizer(args: argparse.Namespace) -> None:
    """The built-in corpus is byte ids: it needs ``NullTokenizer`` with room for them."""
    if not uses_builtin_corpus(args):
        return
    if args.tokenizer_type != "NullTokenizer" or (args.vocab_size or 0) < BYTE_VOCAB_SIZE:
        raise CorpusError(
            f"the built-in corpus (no --data-path / --mock-data) is byte ids 0..255: it needs "
            f"--tokenizer-type NullTokenizer --vocab-size {BYTE_VOCAB_SIZE} or more (got "
            f"{args.tokenizer_type} with --vocab-size {args.vocab_size}); or pass --data-path / --mock-data"
        )


HUB_TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer", "MultimodalTokenizer")
"""Tokenizer types whose ``--tokenizer-model`` may name a Hugging Face Hub repository."""
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_tokenizer_files(args: argparse.Namespace) -> None:
    """``--tokenizer-model``, ``--vocab-file`` and ``--merge-file`` name files that exist (a
    Hugging Face tokenizer's model may be a Hub repository id, ``name`` or ``org/name``).
    Megatron-LM finds a missing one when it builds the tokenizer, where Hugging Face reports
    a missing path as a malformed repository id."""
    for flag in ("tokenizer_model", "vocab_file", "merge_file"):
        path = getattr(args, flag, None)
        if not path or os.path.exists(path):
            continue
        if flag == "tokenizer_model" and args.tokenizer_type in HUB_TOKENIZERS and _REPO_ID.fullmatch(path):
            continue  # a Hub repository id: fetched (or found in the cache) when the tokenizer is built
        raise CorpusError(
            f"--{flag.replace('_', '-')} {path} does not exist (--tokenizer-type {args.tokenizer_type}): "
            "check the path"
            + (", or name a Hugging Face Hub repository as org/name" if args.tokenizer_type in HUB_TOKENIZERS else "")
        )


DATA_PATH_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def check_data_prefixes(args: argparse.Namespace) -> None:
    """Every local ``--data-path`` prefix (and the per-split ones) names an indexed dataset
    (``PREFIX.bin`` and ``PREFIX.idx``); Megatron-LM finds a missing one only once the model is
    built, as a bare assertion. Blend weights and remote paths (``scheme://``) are skipped."""
    if getattr(args, "mock_data", False):
        return
    for flag in DATA_PATH_FLAGS:
        for item in getattr(args, flag, None) or []:
            try:
                float(item)
                continue  # a blend weight
            except ValueError:
                pass
            if "://" in item:
                continue
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(item + ext)]
            if missing:
                raise CorpusError(
                    f"--{flag.replace('_', '-')} {item}: {' and '.join(item + e for e in missing)} not found; give the "
                    "prefix of a dataset that tools/preprocess_data.py wrote (PREFIX.bin and PREFIX.idx)"
                )


def cache_dir(args: argparse.Namespace) -> Path:
    if args.data_cache_path:
        return Path(args.data_cache_path)
    return Path(os.environ.get("MEGATRON_MUON_CACHE", Path.home() / ".cache" / "megatron_muon"))


def stdlib_files() -> List[Path]:
    """This Python's standard-library ``.py`` files, sorted (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def write_indexed_dataset(prefix: str, documents: Iterable[Sequence[int]], vocab_size: int) -> int:
    """Write ``prefix.bin`` / ``prefix.idx`` (one document per item) with Megatron's builder.
    Returns the number of documents written (empty ones are skipped)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    count = 0
    for tokens in documents:
        if len(tokens):
            builder.add_document(np.asarray(tokens, dtype=dtype), [len(tokens)])
            count += 1
    builder.finalize(prefix + ".idx")
    return count


def stdlib_corpus_prefix(args: argparse.Namespace) -> str:
    """The indexed-dataset prefix of the built-in corpus, building it on first use.

    Local rank 0 writes it into a temporary directory renamed into place (concurrent
    builders never see a partial corpus); every rank then meets at a barrier.
    """
    from megatron.training import get_tokenizer

    eod = int(get_tokenizer().eod)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    if not files:
        raise CorpusError(f"no standard-library sources under {root}; pass --data-path or --mock-data")
    digest = hashlib.sha256(f"{sys.version_info[:2]} eod={eod}".encode())
    for f in files:
        digest.update(f"{f.relative_to(root).as_posix()}:{f.stat().st_size}\n".encode())
    final = cache_dir(args) / f"stdlib_corpus-py{sys.version_info[0]}{sys.version_info[1]}-{digest.hexdigest()[:16]}"
    prefix = str(final / STDLIB_PREFIX)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(prefix + ".idx"):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))

        def documents() -> Iterator[List[int]]:
            for f in files:
                yield list(f.read_bytes()) + [eod]

        write_indexed_dataset(str(tmp / STDLIB_PREFIX), documents(), eod + 1)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return prefix


def check_splits_not_empty(config, num_samples: Sequence[int]) -> None:
    """Raise ``CorpusError`` if a split asked for samples has no documents in some dataset of
    the blend: Megatron's ``GPTDataset`` would loop forever in ``_get_num_epochs`` (a small
    corpus with the default ``--split 969,30,1`` has no test documents). Counts documents as
    Megatron's builder does."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if config.blend is None or config.split_matrix is None:
        return  # per-split blends: each split names its own files
    for prefix in config.blend[0]:
        documents = GPTDataset.numel_low_level_dataset(GPTDataset.build_low_level_dataset(prefix, config))
        for name, wanted, bounds in zip(SPLITS, num_samples, config.split_matrix):
            if not wanted or bounds is None:
                continue
            begin, end = (int(round(b * float(documents))) for b in bounds)
            if end <= begin:
                raise CorpusError(
                    f"the {name} split of {prefix} is empty: {documents} documents with --split "
                    f"{config.split} give it none, but {wanted} {name} samples are needed; give it a larger "
                    f"share (e.g. --split 90,8,2){' or --eval-iters 0' if name != 'train' else ''}"
                )
