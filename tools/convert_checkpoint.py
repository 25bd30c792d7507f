"""Convert and inspect Megatron checkpoints for megatron-muon.

python tools/convert_checkpoint.py adam-to-muon SRC DST [--momentum zeros|exp_avg]
python tools/convert_checkpoint.py muon-to-adam SRC DST [--exp-avg zeros|momentum] [--beta1 0.9]
python tools/convert_checkpoint.py to-torch-dist SRC DST     # Megatron-FSDP -> DistributedOptimizer
python tools/convert_checkpoint.py to-fsdp-dtensor SRC DST   # DistributedOptimizer -> Megatron-FSDP
python tools/convert_checkpoint.py experts SRC.pt DST.pt --to sequential|legacy_grouped [--num-experts E]
python tools/convert_checkpoint.py inspect CKPT
"""

from megatron_muon.megatron_lm import cpu

if not cpu.use_cuda():
    # Before Megatron-core is imported: its notices that transformer-engine / Apex are absent
    # (one per module it imports) are expected without a GPU and say nothing about the checkpoint.
    cpu.quiet_missing_extension_notices()

with cpu.plain_fused_functions():  # Megatron-core's first import; the converter runs no model code
    from megatron_muon.megatron_lm.convert import main
    from megatron_muon.megatron_lm.process_lifetime import tie_children_to_this_process

if __name__ == "__main__":
    tie_children_to_this_process()  # Megatron-core's checkpoint writers and the re-save's torchrun end with it
    main()
