"""Training data: Megatron-core datasets and the micro-batch iterators that feed the schedule.

Three sources, as in Megatron-LM:

* ``--data-path``: Megatron indexed datasets (``.bin``/``.idx``, e.g. from
  ``tools/preprocess_data.py``), blended and split by ``BlendedMegatronDatasetBuilder``;
* ``--mock-data``: Megatron-core's ``MockGPTDataset``;
* neither: the **stdlib corpus**, the byte-level tokens of this Python's own standard
  library source files (sorted, one document per file), written once as an indexed
  dataset under the cache directory and then used exactly like ``--data-path`` (default
  split ``98,2,0``: the last 2% of files, in sorted order, are the validation set).

Megatron-core's C++ index helpers (``megatron.core.datasets.helpers_cpp``) ship compiled in
the megatron-core wheel; :func:`check_dataset_helpers` says how to build them if not.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

STDLIB_PREFIX = "stdlib_text_document"


def cache_dir(args: argparse.Namespace) -> Path:
    """``--data-cache-path``, else ``$MEGATRON_MUON_CACHE``, else ``~/.cache/megatron_muon``."""
    if args.data_cache_path:
        return Path(args.data_cache_path)
    return Path(os.environ.get("MEGATRON_MUON_CACHE", Path.home() / ".cache" / "megatron_muon"))


def check_dataset_helpers() -> None:
    """Fail clearly if Megatron-core's compiled dataset helpers are missing."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "megatron.core.datasets.helpers_cpp (Megatron-core's C++ dataset index helpers) is not "
            "available. Wheels of megatron-core ship it prebuilt; for a source install run "
            "`make -C <site-packages>/megatron/core/datasets` (needs a C++ compiler and pybind11)."
        ) from exc


# ---------------------------------------------------------------------------------------
# The stdlib corpus
# ---------------------------------------------------------------------------------------


def stdlib_files() -> List[Path]:
    """This Python's standard-library ``.py`` files, sorted (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _corpus_key(files: Sequence[Path], root: Path) -> str:
    digest = hashlib.sha256(f"{sys.version_info[:2]}".encode())
    for f in files:
        digest.update(f"{f.relative_to(root).as_posix()}:{f.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def write_indexed_dataset(prefix: str, documents: Iterator[List[int]], vocab_size: int) -> None:
    """Write ``prefix.bin`` / ``prefix.idx`` (one document per item) with Megatron's builder."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for tokens in documents:
        if tokens:
            builder.add_document(np.asarray(tokens, dtype=dtype), [len(tokens)])
    builder.finalize(prefix + ".idx")


def stdlib_corpus_prefix(args: argparse.Namespace, tokenizer) -> str:
    """The indexed-dataset prefix of the stdlib corpus, building it on first use.

    Built by local rank 0 into a temporary directory that is renamed into place, so
    concurrent builders (several nodes, several test runs) never see a partial corpus.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    if not files:
        raise RuntimeError(f"no standard-library sources found under {root}; pass --data-path or --mock-data")
    final = cache_dir(args) / f"stdlib_corpus-py{sys.version_info[0]}{sys.version_info[1]}-{_corpus_key(files, root)}"
    prefix = str(final / STDLIB_PREFIX)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(prefix + ".idx"):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))

        def documents() -> Iterator[List[int]]:
            for f in files:
                yield tokenizer.tokenize_bytes(f.read_bytes()) + [tokenizer.eod]

        write_indexed_dataset(str(tmp / STDLIB_PREFIX), documents(), tokenizer.vocab_size)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep theirs
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return prefix


# ---------------------------------------------------------------------------------------
# Megatron-core datasets
# ---------------------------------------------------------------------------------------


def dataset_sizes(args: argparse.Namespace) -> List[int]:
    """Samples per split, as Megatron-LM computes them for iteration-based training."""
    gbs = args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    eval_iters = args.eval_iters if args.eval_iters else 0
    return [args.train_iters * gbs, evals * eval_iters * gbs, eval_iters * gbs]


def build_datasets(args: argparse.Namespace, tokenizer) -> Tuple[object, Optional[object], Optional[object]]:
    """``(train, valid, test)`` datasets (valid / test may be ``None``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    check_dataset_helpers()
    common = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        path_to_cache=str(cache_dir(args) / "index_cache"),
        mmap_bin_files=True,
    )
    if args.mock_data:
        config, cls = GPTDatasetConfig(blend=None, **common), MockGPTDataset
    else:
        if args.data_path:
            blend, split = get_blend_from_list(args.data_path), args.split or "969,30,1"
        else:
            blend, split = ([stdlib_corpus_prefix(args, tokenizer)], None), args.split or "98,2,0"
        config, cls = GPTDatasetConfig(blend=blend, split=split, **common), GPTDataset
    builder = BlendedMegatronDatasetBuilder(cls, dataset_sizes(args), lambda: True, config)
    train, valid, test = builder.build()
    if train is None or len(train) == 0:
        raise RuntimeError("the training split is empty; check --split and the data")
    return train, valid, test


def describe_data(args: argparse.Namespace) -> str:
    if args.mock_data:
        return "mock data (MockGPTDataset)"
    if args.data_path:
        return f"indexed datasets {args.data_path}"
    return f"the Python {sys.version_info[0]}.{sys.version_info[1]} standard library's sources, byte tokens"


# ---------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------


def _collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


class MicroBatches:
    """This data-parallel rank's micro-batches, global batch after global batch.

    Sample order is Megatron-LM's ``MegatronPretrainingSampler``: a global batch is the
    next ``global_batch_size`` samples; its micro-batch ``j`` on DP rank ``r`` is samples
    ``j*mbs*dp + r*mbs ... + mbs``. ``consumed_samples`` is where to start (resume).
    """

    def __init__(
        self, dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, cycle: bool = False
    ) -> None:
        self.dataset = dataset
        self.next_sample = consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.cycle = cycle

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        n = len(self.dataset)
        start = self.next_sample + self.dp_rank * self.mbs
        if start + self.mbs > n and not self.cycle:
            raise StopIteration
        batch = _collate([self.dataset[(start + i) % n] for i in range(self.mbs)])
        self.next_sample += self.mbs * self.dp_size
        return batch


def slice_for_context_parallel(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This context-parallel rank's part of every sequence (Megatron's load-balanced
    split: the sequence in ``2 x CP`` chunks, rank ``r`` keeps chunks ``r`` and ``2CP-1-r``)."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return batch
    rank = parallel_state.get_context_parallel_rank()
    out = {}
    for key, value in batch.items():
        chunks = value.view(value.shape[0], 2 * cp, value.shape[1] // (2 * cp), *value.shape[2:])
        keep = torch.tensor([rank, 2 * cp - rank - 1])
        out[key] = chunks.index_select(1, keep).reshape(value.shape[0], -1, *value.shape[2:])
    return out
