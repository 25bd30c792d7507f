"""What every benchmark script shares: the launcher (gloo ranks on the CPU, NCCL on GPUs),
the description of the machine a result came from, timing statistics, and the JSON /
markdown / plain-text outputs.

Results always carry the date, the machine (``torch.cuda.get_device_name`` on a GPU, the
CPU model otherwise), the library versions and the exact command, so a number in the docs
can be traced to the run that produced it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where results go unless --out says otherwise; $MEGATRON_MUON_BENCH_OUT redirects it (the
# docs tests run the documented commands without touching the committed results).
DEFAULT_OUT = Path(os.environ.get("MEGATRON_MUON_BENCH_OUT", REPO_ROOT / "runs" / "bench"))
"""Where results go unless ``--out`` says otherwise: ``runs/`` is not tracked, so a run never
rewrites the results the docs quote (``docs/bench``; write there with ``--out docs/bench``)."""
DOCS_OUT = REPO_ROOT / "docs" / "bench"


# ---------------------------------------------------------------------------------------
# Devices and the machine
# ---------------------------------------------------------------------------------------


def pick_device(requested: str = "auto") -> str:
    """'cuda' when a GPU is usable (and not refused), else 'cpu'."""
    import torch

    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """``torch.cuda.get_device_name()`` on a GPU; the CPU model and core count otherwise."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU: {cpu_model()} ({os.cpu_count()} cores)"


def environment(device: str) -> Dict[str, Any]:
    """Date, machine, versions and command of this run (stored with every result)."""
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        versions["cuda"] = torch.version.cuda
        versions["cudnn"] = torch.backends.cudnn.version()
    for package in ("megatron.core", "emerging_optimizers"):
        with contextlib.suppress(Exception):
            module = __import__(package, fromlist=["__version__"])
            versions[package] = getattr(module, "__version__", "?")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "device_name": device_name(device),
        "host": socket.gethostname(),
        "versions": versions,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
    }


def synchronize(device: str) -> None:
    """Wait for queued GPU work (a no-op on the CPU) so a timer measures the work."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# ---------------------------------------------------------------------------------------
# Launching ranks
# ---------------------------------------------------------------------------------------


def copy_ms(moved: Dict[str, int], gbps: Dict[str, float]) -> float:
    """The time to move ``moved`` bytes each way (``h2d``, ``d2h``) at the measured rates
    (GB/s): the longer direction, both directions overlapping (the CPU offload's floor)."""
    return max(moved["h2d"] / gbps["h2d"], moved["d2h"] / gbps["d2h"]) / 1e6


def quiet() -> None:
    """Silence Megatron's per-rank warnings (CPU RNG tracker, fallbacks) in benchmark output."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("emerging_optimizers").setLevel(logging.ERROR)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    device: str = "cpu",
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    timeout_s: float = 900.0,
    seed: int = 1234,
) -> List[Any]:
    """Run ``fn(*args)`` on every rank of a Megatron layout; the per-rank results, in order.

    CPU: ``world`` gloo ranks spawned by ``megatron_muon.testing.run_distributed``.
    CUDA: this process is one rank (under ``torchrun``, or alone when ``world == 1``),
    with NCCL for GPU tensors and gloo for CPU ones; every rank gets every result.
    """
    if device == "cpu":
        from megatron_muon.testing import run_distributed

        # Spawned ranks re-import Megatron; keep its import-time warnings out of the output.
        with _env(PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore")):
            return run_distributed(fn, world, *args, tp=tp, pp=pp, ep=ep, etp=etp, timeout_s=timeout_s, seed=seed)
    return _launch_cuda(fn, world, args, tp, pp, ep, etp, seed)


def _launch_cuda(fn, world, args, tp, pp, ep, etp, seed) -> List[Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            if world != 1:
                raise SystemExit(
                    f"{world} ranks on CUDA: start the script with "
                    f"`torchrun --nproc-per-node {world} ...` (one process per GPU)."
                )
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # CPU tensors (loss bookkeeping, plans) over gloo, GPU tensors over NCCL.
        dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    if dist.get_world_size() != world:
        raise SystemExit(f"asked for {world} ranks but torch.distributed has {dist.get_world_size()}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    try:
        result = fn(*args)
        results: List[Any] = [None] * world
        dist.all_gather_object(results, result)
    finally:
        parallel_state.destroy_model_parallel()
    return results


def is_main_process() -> bool:
    """False on the non-zero ranks of a ``torchrun`` launch (they print and write nothing)."""
    return int(os.environ.get("RANK", "0")) == 0


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if value == 0:
            return "0"
        if abs(value) >= 1000 or abs(value) < 0.01:
            return f"{value:.3g}"
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return "n/a" if value is None else str(value)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table, aligned for a terminal."""
    cells = [list(headers)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def provenance(env: Dict[str, Any]) -> str:
    """One markdown line: when, where and how a result was produced."""
    cuda = f", CUDA {env['versions']['cuda']}" if env["versions"].get("cuda") else ""
    return f"_{env['date']}, {env['device_name']}, torch {env['versions'].get('torch')}{cuda}; command: `{env['command']}`_"


def write_outputs(out_dir: Path, name: str, data: Dict[str, Any], markdown: str) -> Dict[str, Path]:
    """``<out>/<name>.json`` (everything) and ``<out>/<name>.md`` (the tables)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return {"json": json_path, "markdown": md_path}
