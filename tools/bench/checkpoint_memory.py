#!/usr/bin/env python
"""What a checkpoint save and load cost each rank, as data parallelism grows.

One model (a 4-layer GQA SwiGLU GPT, ``--hidden``), data-parallel sizes ``--dp`` (1 2 4 8),
and per size each peer: Megatron's ``DistributedOptimizer`` + AdamW saving its optimizer
state as Megatron-LM does by default (``dp_reshardable``: each rank's buffer shard, no
communication, reshardable across DP only) and as ``fully_reshardable`` (gathered, model
coordinates: the one that reshards across TP / PP like ours), and ours (Muon, torch_dist).
Each peer: one training step, then ``dist_checkpointing.save`` of the model and optimizer
state, then ``dist_checkpointing.load`` of it into the same ranks and the optimizer's
``load_state_dict``. Per rank:

* extra memory: the peak resident memory over the save (over the load), minus the resident
  memory just before it (Linux's high-water mark, reset before each: ``/proc/self/clear_refs``);
* bytes sent: what the rank put into ``torch.distributed`` collectives during it
  (``megatron_muon.testing.traffic``).

The table shows the largest rank's figures and ours over each AdamW. CPU ranks (gloo).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common  # noqa: E402

PEERS = {
    "adamw_dp_reshardable": "Megatron AdamW, dp_reshardable (Megatron-LM's default)",
    "adamw_fully_reshardable": "Megatron AdamW, fully_reshardable",
    "ours": "ours (Muon)",
}


def _status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class Measured:
    """The peak memory above the start and the bytes this rank sends, over a block."""

    def __enter__(self) -> "Measured":
        import gc

        from megatron_muon.testing.traffic import count_collectives

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from now
        self.start = _status("VmRSS")
        self._traffic = count_collectives()
        self.traffic = self._traffic.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._traffic.__exit__(*exc)
        self.extra = _status("VmHWM") - self.start
        self.sent = self.traffic.total


def rank_main(peer: str, spec_kwargs: Dict[str, Any], directory: str) -> Dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_muon.checkpoint.training_state import model_sharded_state_dict
    from megatron_muon.testing import models as M
    from tools.bench import peers

    common.quiet()
    spec = M.TinyModelSpec(bf16=True, **spec_kwargs)
    chunks, model, opt, _ = peers.build(
        "megatron_adamw" if peer.startswith("adamw") else "ours_exact", spec, peers.Hyper()
    )
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, M.synthetic_batches(spec, 8, 1)[0], 1, spec)
    ok, _, _ = opt.step()
    assert ok
    metadata = {"distrib_optim_sharding_type": peer.removeprefix("adamw_")} if peer.startswith("adamw") else None

    def state(is_loading: bool) -> Dict[str, Any]:
        model_sd = model_sharded_state_dict(model)
        return {
            "model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
        }

    path = os.path.join(directory, peer)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    with Measured() as save:
        dist_checkpointing.save(state(False), path)
    dist.barrier()
    with Measured() as load:
        loaded = dist_checkpointing.load(state(True), path)
        opt.load_state_dict(loaded["optimizer"])
    dist.barrier()
    return dict(save_extra=save.extra, save_sent=save.sent, load_extra=load.extra, load_sent=load.sent)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    spec = dict(kind="gqa", num_layers=4, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                num_attention_heads=8, num_query_groups=2, vocab_size=256, seq_length=64)  # fmt: skip
    results: Dict[str, Dict[str, Any]] = {}
    started = time.time()
    for dp in args.dp:
        for peer in PEERS:
            with tempfile.TemporaryDirectory() as directory:
                ranks = common.launch(rank_main, dp, peer, spec, directory, timeout_s=1800)
            results[f"{dp}/{peer}"] = {k: max(r[k] for r in ranks) for k in ranks[0]}
            print(f"DP{dp} {peer}: {results[f'{dp}/{peer}']}", flush=True)
    return dict(environment=common.environment("cpu"), spec=spec, dp=args.dp, results=results,
                wall_s=time.time() - started)  # fmt: skip


def markdown(data: Dict[str, Any]) -> str:
    mb = 1 << 20
    rows: List[list] = []
    for dp in data["dp"]:
        r = {peer: data["results"][f"{dp}/{peer}"] for peer in PEERS}
        for peer in PEERS:
            x = r[peer]
            rows.append([
                dp, PEERS[peer], f"{x['save_extra'] / mb:.1f}", f"{x['load_extra'] / mb:.1f}",
                common.human_bytes(x["save_sent"]), common.human_bytes(x["load_sent"]),
            ])  # fmt: skip
        ours = r["ours"]
        for peer in ("adamw_dp_reshardable", "adamw_fully_reshardable"):
            a = r[peer]
            rows.append([
                dp, f"ours / {PEERS[peer].split(',')[1].strip().split(' ')[0]}",
                f"{ours['save_extra'] / max(a['save_extra'], 1):.2f}x", f"{ours['load_extra'] / max(a['load_extra'], 1):.2f}x",
                "", "",
            ])  # fmt: skip
    headers = ["DP", "optimizer state", "save: extra MB", "load: extra MB", "save: sent", "load: sent"]
    return "\n".join(
        [
            "## Checkpoint save and load: extra memory and bytes sent per rank (largest rank)",
            "",
            f"Model: {data['spec']}.",
            "",
            common.md_table(headers, rows),
            "",
            common.provenance(data["environment"]),
        ]
    )


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2304)
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    args = p.parse_args(argv)
    data = run(args)
    text = markdown(data)
    print(text)
    paths = common.write_outputs(args.out, "checkpoint_memory", data, text)
    print(f"\nwrote {paths['json']} and {paths['markdown']} ({data['wall_s']:.0f} s)")
    return data


if __name__ == "__main__":
    main()
