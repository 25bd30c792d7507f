#!/usr/bin/env python
"""Pretrain GPT with Megatron-LM's own training loop and megatron_muon's Muon.

Megatron-LM's arguments (``--optimizer muon`` for megatron_muon's Muon), plus ``--recipe``;
see ``megatron_muon.megatron_lm.pretrain_gpt``. Examples::

    python tools/pretrain_gpt.py --recipe tiny_gqa --train-iters 30
    torchrun --nproc-per-node 2 tools/pretrain_gpt.py --recipe tiny_gqa --tensor-model-parallel-size 2
"""

import sys

from megatron_muon.megatron_lm.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
