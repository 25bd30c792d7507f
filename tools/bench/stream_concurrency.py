#!/usr/bin/env python
"""Does Newton–Schulz on a side CUDA stream run concurrently with a transformer forward?

    python tools/bench/stream_concurrency.py [--reps 10]

The question behind ``muon_step_overlap="forward"`` (issue 39, ``exposed_step.py``): a
step finished while the next forward runs is free only where the GPU has room for both. On
one GPU, bf16, this times a plain-torch forward of ``optimizer_step.py``'s ``medium`` model
(8 layers, d2048, GQA 16/4 heads of 128, SwiGLU 5632; 4 x 1024 tokens), then our
Newton–Schulz of that model's Muon matrices stacked by shape as the step stacks them (all
layers' or one layer's), then both at once, Newton–Schulz on a side stream. It prints each
median and how much of the shorter one disappeared: 0 % is serial, 100 % is fully
concurrent. On the CPU (no streams) it runs a small model serially: a smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from megatron_muon.rule import newton_schulz

MEDIUM = dict(layers=8, hidden=2048, ffn=5632, heads=16, groups=4, head_dim=128, batch=4, seq=1024)
SMALL = dict(layers=2, hidden=256, ffn=512, heads=4, groups=2, head_dim=64, batch=1, seq=64)


class Workload:
    """The forward's weights and input, and the Newton–Schulz stacks of the same model."""

    def __init__(self, shape: Dict[str, int], device: str) -> None:
        self.s, self.device = shape, device
        # bf16 as on the GPU it measures; fp32 on a CPU (a smoke run), whose bf16 attention
        # kernel fails under an ATEN_CPU_CAPABILITY below the hardware's ("pack_vnni2 is only
        # supported when avx512 is supported", torch 2.11).
        s, bf = shape, torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        q, kv = s["heads"] * s["head_dim"], s["groups"] * s["head_dim"]

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=bf) * 0.02

        self.layers = [
            dict(
                qkv=w(s["hidden"], q + 2 * kv),
                proj=w(q, s["hidden"]),
                fc1=w(s["hidden"], 2 * s["ffn"]),
                fc2=w(s["ffn"], s["hidden"]),
            )  # fmt: skip
            for _ in range(s["layers"])
        ]
        self.x = torch.randn(s["batch"], s["seq"], s["hidden"], device=device, dtype=bf)
        self.norm = torch.ones(s["hidden"], device=device, dtype=bf)
        # Muon's logical matrices (Q, K, V apart; gate and up of fc1 apart), stacked by shape.
        counts: Dict[tuple, int] = {}
        for shape in [(q, s["hidden"]), (kv, s["hidden"]), (kv, s["hidden"]), (s["hidden"], q),
                      (s["ffn"], s["hidden"]), (s["ffn"], s["hidden"]), (s["hidden"], s["ffn"])]:  # fmt: skip
            counts[shape] = counts.get(shape, 0) + 1
        self.stacks = {
            n: [torch.randn(c * n, *shape, device=device) for shape, c in counts.items()] for n in (1, s["layers"])
        }

    def forward(self) -> torch.Tensor:
        s = self.s
        b, t, heads, groups, d = s["batch"], s["seq"], s["heads"], s["groups"], s["head_dim"]
        x = self.x
        for w in self.layers:
            h = F.rms_norm(x, (s["hidden"],), self.norm)
            q, k, v = (h @ w["qkv"]).split([heads * d, groups * d, groups * d], dim=-1)
            q = q.view(b, t, heads, d).transpose(1, 2)
            k = k.view(b, t, groups, d).transpose(1, 2).repeat_interleave(heads // groups, dim=1)
            v = v.view(b, t, groups, d).transpose(1, 2).repeat_interleave(heads // groups, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, heads * d)
            x = x + a @ w["proj"]
            gate, up = (F.rms_norm(x, (s["hidden"],), self.norm) @ w["fc1"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["fc2"]
        return x

    def newton_schulz(self, layers: int) -> None:
        for stack in self.stacks[layers]:
            newton_schulz(stack, 5, "quintic", torch.bfloat16)


def median_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` calls after two warm-up calls, synchronised."""
    times = []
    for i in range(reps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def both(work: Workload, layers: int, side) -> None:
    """The forward on the current stream, Newton–Schulz on ``side`` (serially without CUDA)."""
    if side is None:
        work.newton_schulz(layers)
        work.forward()
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work.newton_schulz(layers)
    work.forward()
    torch.cuda.current_stream().wait_stream(side)


def run(reps: int) -> List[Dict[str, float]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Workload(MEDIUM if device == "cuda" else SMALL, device)
    side = torch.cuda.Stream() if device == "cuda" else None
    rows = []
    with torch.no_grad():
        for layers in (work.s["layers"], 1):
            f = median_ms(work.forward, device, reps)
            n = median_ms(lambda: work.newton_schulz(layers), device, reps)
            b = median_ms(lambda: both(work, layers, side), device, reps)
            rows.append(dict(device=device, ns_layers=layers, forward_ms=f, ns_ms=n, both_ms=b,
                             hidden=(f + n - b) / min(f, n)))  # fmt: skip
    return rows


def main(argv=None) -> List[Dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10)
    rows = run(p.parse_args(argv).reps)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    for r in rows:
        print(
            f"{name}: forward {r['forward_ms']:.2f} ms, Newton-Schulz of {r['ns_layers']} layer(s) {r['ns_ms']:.2f} ms, "
            f"both (NS on a side stream) {r['both_ms']:.2f} ms against {r['forward_ms'] + r['ns_ms']:.2f} serial: "
            f"{r['hidden']:.0%} of the shorter hidden"
        )
    return rows


if __name__ == "__main__":
    main()
