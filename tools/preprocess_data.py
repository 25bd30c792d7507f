#!/usr/bin/env python
"""Text / JSONL -> Megatron indexed dataset (.bin/.idx), as Megatron-LM's tool of this name.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix data/corpus --append-eod
    python tools/pretrain_gpt.py --recipe tiny_gqa --data-path data/corpus_text_document

See ``megatron_muon.megatron_lm.preprocess``.
"""

import sys

from megatron_muon.megatron_lm.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
