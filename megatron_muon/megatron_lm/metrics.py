"""Training logs in Megatron-LM's format, plus TensorBoard and a JSON-lines metrics file.

One line every ``--log-interval`` iterations, printed by the first rank of the last
pipeline stage (which holds the loss)::

     [2025-01-01 12:00:00] iteration       10/     100 | consumed samples:          320 |
     elapsed time per iteration (ms): 12.3 | tokens per second: 41600.0 | learning rate:
     1.000000E-03 | global batch size:    32 | lm loss: 4.321000E+00 | loss scale: 1.0 |
     grad norm: 0.812 | max attention logit: 12.345 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

(on one line). Losses are averaged over the interval's iterations, as in Megatron-LM.
``--metrics-file`` records every iteration's values at full precision (one JSON object
per line) for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Dict, Optional

from .distributed import is_logging_rank


class TrainLogger:
    """Accumulates per-iteration statistics and writes them out."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.active = is_logging_rank()
        self.writer = self._tensorboard(args.tensorboard_dir) if self.active else None
        self.metrics = open(args.metrics_file, "a", encoding="utf-8") if self.active and args.metrics_file else None
        self._reset()

    @staticmethod
    def _tensorboard(path: Optional[str]):
        if not path:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print(f"WARNING: --tensorboard-dir {path} ignored: the `tensorboard` package is not installed.", flush=True)
            return None
        return SummaryWriter(log_dir=path, max_queue=1000)

    def _reset(self) -> None:
        self.loss_sum: Dict[str, float] = {}
        self.loss_count = 0
        self.skipped = 0
        self.nans = 0
        self.iterations = 0
        self.start = time.perf_counter()

    def record(self, iteration: int, consumed_samples: int, losses: Dict[str, float], lr: float,
               grad_norm: Optional[float], loss_scale: float, skipped: bool,
               max_logit: Optional[float] = None) -> None:
        """Account one iteration; print a line when the interval is complete."""
        self.iterations += 1
        nan = any(not math.isfinite(v) for v in losses.values())
        self.nans += int(nan)
        self.skipped += int(skipped)
        if not skipped and not nan:
            self.loss_count += 1
            for k, v in losses.items():
                self.loss_sum[k] = self.loss_sum.get(k, 0.0) + v
        if not self.active:
            if iteration % self.args.log_interval == 0:
                self._reset()
            return
        values: Dict[str, Any] = dict(losses, lr=lr, grad_norm=grad_norm, loss_scale=loss_scale)
        if max_logit is not None:
            values["max_attention_logit"] = max_logit
        if self.metrics:
            self.metrics.write(json.dumps(dict(iteration=iteration, skipped=skipped, **values)) + "\n")
            self.metrics.flush()
        if self.writer:
            for k, v in values.items():
                if v is not None:
                    self.writer.add_scalar(k.replace("_", " "), v, iteration)
        if iteration % self.args.log_interval == 0:
            self._print(iteration, consumed_samples, lr, grad_norm, loss_scale, max_logit)
            self._reset()

    def _print(self, iteration, consumed_samples, lr, grad_norm, loss_scale, max_logit) -> None:
        args = self.args
        elapsed = (time.perf_counter() - self.start) / max(1, self.iterations)
        tokens = args.global_batch_size * args.seq_length
        parts = [
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{args.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {elapsed * 1000.0:.1f}",
            f"tokens per second: {tokens / elapsed:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {args.global_batch_size:5d}",
        ]
        for k, v in self.loss_sum.items():
            parts.append(f"{k}: {v / max(1, self.loss_count):.6E}")
        parts.append(f"loss scale: {loss_scale:.1f}")
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        if max_logit is not None:
            parts.append(f"max attention logit: {max_logit:.3f}")
        parts.append(f"number of skipped iterations: {self.skipped:3d}")
        parts.append(f"number of nan iterations: {self.nans:3d}")
        print(" | ".join(parts) + " |", flush=True)

    def record_eval(self, iteration: int, losses: Dict[str, float], label: str) -> None:
        """Print Megatron-LM's validation block."""
        if not self.active:
            return
        parts = []
        for k, v in losses.items():
            parts.append(f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(20.0, v)):.6E}")
            if self.writer:
                self.writer.add_scalar(f"{k} validation", v, iteration)
        line = f" {label} loss at iteration {iteration} | " + " | ".join(parts) + " |"
        bar = "-" * len(line)
        print(f"{bar}\n{line}\n{bar}", flush=True)
        if self.metrics:
            self.metrics.write(json.dumps(dict(iteration=iteration, split=label, **losses)) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.metrics:
            self.metrics.close()
