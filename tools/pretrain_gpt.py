#!/usr/bin/env python
"""Megatron-LM's ``pretrain_gpt.py``, for Megatron-core with the Muon optimizer.

Same arguments as Megatron-LM (``--optimizer muon`` for megatron_muon's Muon); see
``megatron_muon.megatron_lm.pretrain``. Examples::

    python tools/pretrain_gpt.py --recipe tiny_gqa --train-iters 30
    torchrun --nproc-per-node 2 tools/pretrain_gpt.py --recipe tiny_gqa --tensor-model-parallel-size 2
"""

import sys

from megatron_muon.megatron_lm.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
