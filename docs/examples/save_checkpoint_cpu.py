"""Train the tiny GQA model two steps with Muon on one CPU process and save a reshardable
(torch_dist) checkpoint: ``python docs/examples/save_checkpoint_cpu.py CKPT_DIR``.

On GPUs the same three calls (build, ``get_muon_optimizer``, ``save_checkpoint``) run in
every rank of a ``torchrun`` launch; the CPU patches and the one-rank process group here
only stand in for that.
"""

import sys
import tempfile

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_muon import MuonConfig, get_muon_optimizer
from megatron_muon.checkpoint import save_checkpoint
from megatron_muon.testing import install_cpu_patches
from megatron_muon.testing import models as M


def main(checkpoint_dir: str) -> None:
    install_cpu_patches()  # Megatron-core on the CPU
    with tempfile.TemporaryDirectory() as rendezvous:
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}/pg", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        spec = M.TinyModelSpec(kind="gqa")
        chunks = M.build_model_chunks(spec)
        model = M.wrap_ddp(chunks, chunks[0].config)
        optimizer = get_muon_optimizer(MuonConfig(lr=0.01), model)
        for tokens in M.synthetic_batches(spec, 8, 2):
            M.train_step(model, optimizer, tokens, 2, spec)
        save_checkpoint(checkpoint_dir, model, optimizer, extra={"iteration": 2})
        torch.distributed.destroy_process_group()
    print(f"saved {checkpoint_dir}")


if __name__ == "__main__":  # needed: Megatron's checkpoint writer starts helper processes
    main(sys.argv[1])
