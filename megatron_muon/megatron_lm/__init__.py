"""A Megatron-LM-compatible pretraining driver for Megatron-core with the Muon optimizer.

``tools/pretrain_gpt.py`` (console script ``megatron-muon-pretrain``) speaks Megatron-LM's
argument names and semantics, so a launch script written for Megatron-LM's
``pretrain_gpt.py`` carries over; ``--optimizer muon`` swaps Megatron's
DistributedOptimizer for :func:`megatron_muon.get_muon_optimizer`.

Modules (each small, one concern):

* ``arguments``   - the Megatron-LM argument parser and its derived values / checks;
* ``recipes``     - ``--recipe``: YAML files of the same flags;
* ``muon_args``   - ``--muon-*`` flags generated from :class:`megatron_muon.MuonConfig`;
* ``distributed`` - device / backend choice, process groups, seeds;
* ``model``       - ``TransformerConfig`` and ``GPTModel`` chunks from the arguments;
* ``sizing``      - parameter counts from the arguments (no model needed);
* ``optim``       - optimizer (adam / sgd / muon) and learning-rate scheduler;
* ``tokenizer``   - the built-in byte tokenizer (and Hugging Face when installed);
* ``data``        - the stdlib corpus, Megatron indexed / mock datasets, batch iterators;
* ``training``    - forward step, train / eval loop;
* ``metrics``     - Megatron-LM style log lines, TensorBoard, JSONL metrics;
* ``checkpointing`` - atomic save / load: per-rank files (same layout) or torch_dist
  (reshardable, the default with Muon);
* ``preprocess``  - text / JSONL to a Megatron indexed dataset;
* ``pretrain``    - ``main()``;
* ``integration`` - ``use_megatron_muon()``: ``--optimizer muon`` inside Megatron-LM's own
  ``pretrain_gpt.py`` (for users with a Megatron-LM checkout).
"""

from .pretrain import main

__all__ = ["main"]
