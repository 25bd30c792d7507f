"""``tools/pretrain_gpt.py``: Megatron-LM's own ``pretrain()`` with megatron_muon on top.

Subprocesses, launched as a user launches them (CPU, gloo): README's first command;
save / resume at another tensor-parallel size against an uninterrupted run; Megatron-LM's
``--exit-on-missing-checkpoint``; one-line exit-2 errors before any model is built; a launch
line from Megatron-LM's GPT examples; a non-finite step ends the job non-zero with a finite
"latest" checkpoint; a small own corpus with the default split fails instead of hanging. In
a spawned process: recipes read by Megatron-LM's parser and validation.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.helpers import REPO, wandb_offline
from tests.helpers.jobs import PRETRAIN, TWO_RANKS, job_env, kill_tagged, launch, losses, run, tagged_processes

ROOT = REPO
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
BUILT, DONE = "[after model, optimizer, and learning rate scheduler are built]", "[after training is done]"
NEEDS_NO_TE = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed")
NEEDS_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs these")
REAL = {  # recipe: (world size that fits its layout, published total / active parameters)
    "llama3_8b": (8, 8.03e9, None),
    "qwen3_30b_a3b": (8, 30.5e9, 3.3e9),
    "moonlight_16b_a3b": (8, 15.29e9 + 163840 * 2048 * 2, 2.24e9 + 163840 * 2048 * 2),  # published w/o embeddings
    "deepseek_v3": (1024, 671e9, 37e9),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache (built-in corpus, dataset indices) for every run of this module."""
    return tmp_path_factory.mktemp("cache")


def validation(stdout: str) -> Dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in VALID.finditer(stdout)}


CHECKPOINT_FACTS = """
import json, sys, torch
from megatron_muon.checkpoint.integrity import has_manifest
from megatron_muon.megatron_lm.checkpoint_dirs import read_checkpoint
out = {}
for path in sys.argv[1:]:
    c = read_checkpoint(path)  # verifies the manifest
    bias = [t.tolist() for k, t in sorted(c.tensors.items()) if k.endswith("expert_bias")]
    finite = all(bool(torch.isfinite(t).all()) for t in c.tensors.values() if t.is_floating_point())
    out[path] = dict(manifest=has_manifest(path), finite=finite, expert_bias=bias)
print(json.dumps(out))
"""


def checkpoint_facts(paths: List[Path]) -> Dict[str, dict]:
    """For each torch_dist checkpoint (read in one fresh process, each verified against its
    manifest): whether it has its manifest, whether every floating-point tensor is finite,
    and the routers' expert biases."""
    import json

    return json.loads(run([sys.executable, "-c", CHECKPOINT_FACTS, *map(str, paths)]).strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# README and Megatron-LM's own markers
# ---------------------------------------------------------------------------------------


def short_run(recipe: str, cache: Path, *flags: str, iterations: int = 3) -> List[str]:
    """The driver on ``recipe`` for a few iterations: no warm-up, no evaluation."""
    return PRETRAIN + f"--recipe {recipe} --train-iters {iterations} --lr-warmup-iters 0 --eval-iters 0".split() + [
        "--data-cache-path", str(cache), *flags]  # fmt: skip


def test_readme_first_command():
    """README's first command, after its install step, as written (this venv's bin for .venv/bin):
    Megatron-LM's own loop (its markers) and the validation loss well below the first loss."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"```bash\n(python3.12 -m venv .*?)\n```", readme).group(1)
    train = command.split(" && ")[-1].replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    assert "--optimizer muon" in train and "tiny_moe_mla" in train and "--nproc-per-node 2" in train
    stdout = run(train.split(), timeout=400)
    assert BUILT in stdout and DONE in stdout
    first, valid = losses(stdout)[1], validation(stdout)
    assert len(valid) >= 2 and valid[max(valid)] < 0.6 * first, (first, valid)
    # The argument listing shows what runs: the recipe's QK-Clip is on.
    assert re.search(r"^  qk_clip \.+ True$", stdout, re.M), "the argument listing hides QK-Clip"


def test_tensorboard_and_wandb_hold_megatron_lm_and_muon_scalars(cache, tmp_path):
    """--tensorboard-dir: Megatron-LM's scalars and Muon's (update RMS, max and mean attention
    logit, heads clipped, skipped steps, step time) at every log interval; with a low
    threshold QK-Clip clips heads every step. W&B (offline, --wandb-project) gets the same
    numbers under the same names. The run's record (argument listing, TensorBoard's text,
    W&B's config) holds the Muon settings that run (:func:`_assert_records_muon_settings`)."""
    wandb = tmp_path / "wandb"
    stdout = run(short_run("tiny_moe_mla", cache, "--qk-clip-threshold", "0.01", "--tensorboard-dir",
                           str(tmp_path / "tb"), "--wandb-project", "muon", "--wandb-exp-name", "tb",
                           "--wandb-save-dir", str(wandb), "--muon-momentum", "0.93"))  # fmt: skip
    _assert_records_muon_settings(stdout, tmp_path / "tb", wandb, dict(muon_momentum=0.93, muon_step_overlap="none"))
    scalars = _tensorboard_scalars(tmp_path / "tb")
    logged = wandb_offline.scalars(wandb)
    for tag in ("lm loss", "grad-norm", *(t for t in scalars if t.startswith("muon/"))):
        assert logged.get(tag) == pytest.approx(scalars[tag], rel=1e-6), (tag, logged.get(tag), scalars[tag])
    for tag in (
        "lm loss",
        "grad-norm",
        "max_attention_logit",
        "muon/update-rms",
        "muon/max-attention-logit",
        "muon/mean-attention-logit",
        "muon/qk-clip-heads-clipped",
        "muon/skipped-steps",
        "muon/optimizer-step-ms",
    ):
        assert len(scalars.get(tag, [])) == 3, (tag, sorted(scalars))
    assert all(0.01 < v < 1.0 for v in scalars["muon/update-rms"])
    assert all(v > 0 for v in scalars["muon/qk-clip-heads-clipped"])
    assert scalars["muon/max-attention-logit"] == pytest.approx(scalars["max_attention_logit"])
    # The console says what TensorBoard holds: the max logit in each iteration's line, and
    # where the step runs ('auto' without --overlap-param-gather: inside step()).
    console = [float(v) for v in re.findall(r"\| max attention logit: ([0-9.]+) \|$", stdout, re.M)]
    assert console == pytest.approx(scalars["max_attention_logit"], abs=1e-3), console
    assert "megatron_muon: the Muon step runs whole inside optimizer.step(): --muon-step-overlap auto" in stdout
    assert all(m >= a > 0 for m, a in zip(scalars["muon/max-attention-logit"], scalars["muon/mean-attention-logit"]))


def test_profiler_trace_shows_the_muon_step(cache, tmp_path):
    """Megatron-LM's --profile --use-pytorch-profiler on the CPU: the trace of a profiled
    iteration holds each phase of the Muon step as a ``muon/...`` range, and (the step runs
    whole between the backward and the next forward) Newton-Schulz starts after the
    iteration's last backward operation."""
    import gzip
    import json

    run(short_run("tiny_gqa", cache, "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                  "--profile-step-end", "3", "--tensorboard-dir", str(tmp_path / "tb"), iterations=4))  # fmt: skip
    trace = json.loads(gzip.decompress((tmp_path / "torch_profile" / "rank-0.json.gz").read_bytes()))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    (step,) = [e for e in events if e["name"].startswith("ProfilerStep#")]
    inside = [e for e in events if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    names = {e["name"] for e in inside}
    for phase in ("momentum", "gather", "newton_schulz", "scatter", "update", "adamw", "copy_to_model"):
        assert f"muon/{phase}" in names, (phase, sorted(n for n in names if n.startswith("muon/")))
    backward = max(e["ts"] for e in inside if e["name"].startswith("autograd::engine::evaluate_function"))
    assert all(e["ts"] > backward for e in inside if e["name"] == "muon/newton_schulz")


def _assert_records_muon_settings(stdout: str, tb: Path, wandb: Path, given: dict) -> None:
    """Megatron-LM's argument listing, its TensorBoard text and the W&B config hold every
    command-line ``muon_*`` field of the MuonConfig that ran: ``given``, else MuonConfig's
    default (momentum 0.95, Nesterov, 'moonlight', 'exact'; not Megatron-core's Muon defaults,
    which Megatron-LM's own --muon-* flags carry), and the step-overlap mode 'auto' chose."""
    import dataclasses
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_muon import MuonConfig
    from megatron_muon.megatron_lm import muon_args

    callables = set(muon_args.non_cli_fields())
    ran = MuonConfig(lr=1e-3, **{k: v for k, v in given.items() if k != "muon_step_overlap"})
    expected = {f.name: getattr(ran, f.name) for f in dataclasses.fields(ran) if f.name.startswith("muon_")}
    expected = {k: v for k, v in expected.items() if k not in callables} | given
    assert (expected["muon_momentum"], expected["muon_nesterov"]) == (given.get("muon_momentum", 0.95), True)
    assert (expected["muon_scale_mode"], expected["muon_tp_mode"]) == ("moonlight", "exact")
    listing = dict(re.findall(r"^  (muon_\w+) \.+ (.*)$", stdout, re.M))
    (events,) = list(tb.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    text = {tag.split("/")[0]: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    config = wandb_offline.config(wandb)
    for name, value in expected.items():
        assert listing.get(name) == text.get(name) == str(value), (name, listing.get(name), text.get(name), value)
        assert config.get(name) == json.loads(json.dumps(value, default=str)), (name, config.get(name), value)


def _tensorboard_scalars(directory: Path) -> Dict[str, List[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(directory.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


MEGATRON_FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor"
CLIPPING = "--muon-ns-dtype fp32 --qk-clip --qk-clip-threshold 0.01"
"""Layout comparisons: fp32 Newton–Schulz (in bf16, NS turns reduction-order noise into
~1e-4 loss differences between any two layouts) and QK-Clip clipping at every step."""


@pytest.fixture(scope="module")
def two_rank_runs(cache, tmp_path_factory):
    """``run(recipe, *flags)``: 12 iterations on 2 ranks with :data:`CLIPPING`, once per
    argument list: (lm loss per iteration, TensorBoard scalars)."""
    done = {}

    def run_once(recipe: str, *flags: str):
        if (recipe, flags) not in done:
            tb = tmp_path_factory.mktemp("tb")
            cmd = short_run(recipe, cache, *CLIPPING.split(), *flags, "--tensorboard-dir", str(tb), iterations=12)
            stdout = run(TWO_RANKS[:-1] + cmd[1:], timeout=300)
            done[(recipe, flags)] = (losses(stdout), _tensorboard_scalars(tb))
        return done[(recipe, flags)]

    return run_once


def _same_run(got, want) -> None:
    """Same lm loss at each of 12 iterations within 1e-4 relative, and QK-Clip clipping with
    the same largest logits. (Which heads clip may differ: a head's logit sits at tau after
    its clip, so rounding can put it either side at the next step, for a factor ~1.)"""
    (got_loss, got_tb), (want_loss, want_tb) = got, want
    assert sorted(got_loss) == list(range(1, 13)) and sorted(want_loss) == sorted(got_loss)
    for i in want_loss:
        assert got_loss[i] == pytest.approx(want_loss[i], rel=1e-4), (i, got_loss[i], want_loss[i])
    assert all(v > 0 for v in got_tb["muon/qk-clip-heads-clipped"]), got_tb["muon/max-attention-logit"]
    assert got_tb["muon/max-attention-logit"] == pytest.approx(want_tb["muon/max-attention-logit"], rel=1e-4)


@pytest.mark.slow
def test_context_parallel_logs_the_data_parallel_losses(two_rank_runs):
    """--context-parallel-size 2 on 2 ranks against DP2, on MoE + MLA with expert parallelism
    2 (the experts span the CP ranks): the same global batch, each CP rank holding half of
    every sequence (Megatron's load-balanced split; K/V gathered over CP in our CPU
    attention); QK-Clip takes each head's max over the CP ranks. (MoE under CP started from
    other router weights until Megatron-LM's start-up warm-up stopped drawing from the CPU
    generator: cpu.py's jit_warmup_keeps_the_rng. The dense path is the same attention.)"""
    moe = ("tiny_moe_mla", "--expert-model-parallel-size", "2")
    _same_run(two_rank_runs(*moe, "--context-parallel-size", "2"), two_rank_runs(*moe))


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,layout",
    [
        pytest.param("tiny_gqa", (), id="tiny_gqa-DP2"),
        pytest.param("tiny_moe_mla", ("--expert-model-parallel-size", "2"), id="tiny_moe_mla-EP2"),
    ],
)
def test_megatron_fsdp_logs_the_distributed_optimizer_losses(two_rank_runs, recipe, layout):
    """--use-megatron-fsdp (ZeRO-3: parameters, gradients and optimizer state sharded) on 2
    ranks logs the DistributedOptimizer run's losses; QK-Clip clips at every step, scaling
    Megatron-FSDP's sharded fp32 main weights."""
    _same_run(two_rank_runs(recipe, *layout, *MEGATRON_FSDP.split()), two_rank_runs(recipe, *layout))


def test_deepseek_v3_style_multi_token_prediction_trains(cache, tmp_path):
    """MLA + MoE at EP2 with one MTP layer (DeepSeek-V3's layout): Megatron-LM builds the MTP
    layer with our attention (its own default spec fails on MLA's head sizes), logs its loss,
    both losses fall, and QK-Clip clips the MTP layer's heads as well: with a threshold below
    every logit, all 4 heads of 3 attention layers (2 decoder, 1 MTP) at the first step (later
    a clipped head sits near the threshold and may stay under it)."""
    tb = tmp_path / "tb"
    cmd = short_run("tiny_moe_mla", cache, "--expert-model-parallel-size", "2", "--mtp-num-layers", "1",
                    "--qk-clip-threshold", "0.01", "--tensorboard-dir", str(tb), iterations=8)  # fmt: skip
    stdout = run(TWO_RANKS[:-1] + cmd[1:], timeout=300)
    mtp = {int(i): float(v) for i, v in re.findall(r"iteration\s+(\d+)/.*?\| mtp_1 loss: ([0-9.E+-]+) \|", stdout)}
    lm = losses(stdout)
    assert sorted(mtp) == sorted(lm) == list(range(1, 9)), stdout[-3000:]
    assert lm[8] < lm[1] and mtp[8] < mtp[1], (lm, mtp)
    clipped = _tensorboard_scalars(tb)["muon/qk-clip-heads-clipped"]
    assert clipped[0] == 12.0 and all(0 < n <= 12 for n in clipped), clipped


def test_megatron_core_muon_side_by_side_in_bf16(cache):
    """--muon-impl megatron, the side-by-side peer the docs offer, trains in bf16."""
    stdout = run(short_run("tiny_gqa", cache, "--muon-impl", "megatron", "--bf16"))
    assert sorted(losses(stdout)) == [1, 2, 3] and DONE in stdout


def test_offloaded_muon_masters_train_as_on_the_device(cache):
    """bf16 with --muon-cpu-offload and Megatron-LM's offload flags (the Muon momentum and
    fp32 masters in CPU memory, staged to the device per chunk, where the step updates the
    masters, QK-Clips them and writes the model's parameters): the losses of the run
    without offload, to the last digit (tests/cuda holds the GPU run to the same)."""
    flags = ["--bf16", "--qk-clip", "--qk-clip-threshold", "0.05", "--muon-chunk-numel", "4096"]
    offload = ["--muon-cpu-offload", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
    on_device = losses(run(short_run("tiny_gqa", cache, *flags, iterations=4)))
    stdout = run(short_run("tiny_gqa", cache, *flags, *offload, iterations=4))
    assert sorted(on_device) == [1, 2, 3, 4] and losses(stdout) == on_device
    logits = [float(x) for x in re.findall(r"max attention logit: ([0-9.]+)", stdout)]
    assert len(logits) == 4 and min(logits) > 0.05, logits  # QK-Clip scaled the staged masters every step


@pytest.mark.timeout(600)
def test_expert_parallel_adamw_run_switches_to_muon_and_back(cache, tmp_path):
    """The AdamW peer on the MoE + MLA recipe with expert parallelism (EP2, bf16; Megatron
    chains a dense and an expert distributed optimizer), saved fully reshardable (docs/
    checkpoints.md's walk-through runs the default format, re-saved by the converter). The
    recipe's QK-Clip is Muon's, so it is switched off with one line. The main job's start-up
    check refuses ``--optimizer muon --load`` of it naming the converter; adam-to-muon
    converts both optimizers of the chain and the Muon run resumes from the same weights
    (its first loss is AdamW's); muon-to-adam writes Megatron's chain again and AdamW
    resumes from the Muon run's weights."""
    from megatron_muon.megatron_lm.resume import check_optimizer_to_load

    adam, muon, back = tmp_path / "adam", tmp_path / "muon", tmp_path / "back"
    job = TWO_RANKS + ["--recipe", "tiny_moe_mla", "--expert-model-parallel-size", "2", "--bf16",
                       "--train-iters", "6", "--eval-iters", "0", "--data-cache-path", str(cache)]  # fmt: skip
    adam_job = job + ["--optimizer", "adam", "--dist-ckpt-optim-fully-reshardable"]
    stdout = run(adam_job + ["--save", str(adam), "--save-interval", "3", "--exit-interval", "4"])
    assert "the recipe's QK-Clip (--qk-clip) is megatron_muon's; off with --optimizer adam" in stdout
    on_adam = losses(stdout)
    assert sorted(on_adam) == [1, 2, 3, 4], on_adam
    load = argparse.Namespace(load=str(adam), ckpt_step=3, no_load_optim=False, optimizer="muon", muon_impl="megatron_muon")  # fmt: skip
    with pytest.raises(ValueError, match="holds AdamW state .*convert_checkpoint.py adam-to-muon"):
        check_optimizer_to_load(load)
    stats = run(CONVERT + ["adam-to-muon", str(adam / "iter_0000003"), str(muon)])
    assert "'step': 3" in stats, stats
    on_muon = losses(run(job + ["--load", str(muon), "--save", str(muon), "--save-interval", "5"], timeout=300))
    assert sorted(on_muon) == [4, 5, 6] and on_muon[4] == on_adam[4], (on_muon, on_adam)
    run(CONVERT + ["muon-to-adam", str(muon / "iter_0000005"), str(back)])
    again = losses(run(adam_job + ["--load", str(back)], timeout=300))
    assert sorted(again) == [6] and again[6] == on_muon[6], (again, on_muon)


# ---------------------------------------------------------------------------------------
# Checkpoints: Megatron-LM's --save / --load
# ---------------------------------------------------------------------------------------

COMMON = [
    "--recipe",
    "tiny_gqa",
    "--train-iters",
    "6",
    "--eval-interval",
    "3",
    "--eval-iters",
    "1",
    # Pads the vocabulary alike at TP1 and TP2; lets Megatron-LM load at another TP.
    "--make-vocab-size-divisible-by",
    "256",
    "--dist-ckpt-optim-fully-reshardable",
]


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory):
    """6 iterations of tiny_gqa (Muon), one rank, saving at 3 and 6, as Megatron-LM's first
    run of ``--load X --save X`` (X new)."""
    out = tmp_path_factory.mktemp("run")
    ckpt = ["--load", str(out / "ckpt"), "--save", str(out / "ckpt"), "--save-interval", "3"]
    proc = launch(PRETRAIN + COMMON + ["--data-cache-path", str(cache), *ckpt], timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return dict(stdout=proc.stdout, stderr=proc.stderr, ckpt=out / "ckpt")


def test_routine_notices_are_not_printed(uninterrupted):
    """What every CPU run with saves printed and nobody acts on: Megatron-core's own zero_grad
    reading .grad of non-leaf shard views, its synchronous save's "async save is deprecated",
    the data loader's pin_memory without an accelerator, the TE / Apex import notices."""
    out = uninterrupted["stdout"] + uninterrupted["stderr"]
    assert "Warning" not in out, [line for line in out.splitlines() if "Warning" in line]
    assert "async save is deprecated" not in out


def test_first_run_of_load_and_save_in_one_directory_says_it_starts_new(uninterrupted):
    """Megatron-LM's convention ``--load X --save X`` on a new X starts a run, with one line
    that says so (a --load that names no checkpoint elsewhere is refused: BAD_INPUT)."""
    ckpt = uninterrupted["ckpt"]
    said = [line for line in uninterrupted["stdout"].splitlines() if line.startswith("megatron_muon: --load")]
    assert said == [
        f"megatron_muon: --load {ckpt} holds no checkpoint (no latest_checkpointed_iteration.txt, no iterations): "
        f"a new run starts from scratch and saves into {ckpt} (--exit-on-missing-checkpoint stops instead)"
    ]


def test_save_then_resume_same_and_other_tensor_parallel_size(uninterrupted, cache):
    """Load iteration 3 at TP1 (iterations 4..6 repeat the uninterrupted run exactly, as logged:
    Megatron-LM's own second log line of a job averaged its first two iterations, 4 and 5)
    and under torchrun at TP2 (the same to reduction-order noise)."""
    ckpt = uninterrupted["ckpt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (ckpt / "iter_0000003" / ".metadata").is_file()  # torch_dist
    full = losses(uninterrupted["stdout"])
    assert sorted(full) == list(range(1, 7)) and full[6] < full[1] - 1.0
    resume = COMMON + ["--data-cache-path", str(cache), "--load", str(ckpt), "--ckpt-step", "3"]
    same = run(PRETRAIN + resume)
    assert sorted(losses(same)) == [4, 5, 6]
    assert all(losses(same)[i] == full[i] for i in (4, 5, 6)), (losses(same), full)
    assert validation(same)[6] == validation(uninterrupted["stdout"])[6]
    tp2 = run(TWO_RANKS + resume + ["--tensor-model-parallel-size", "2"], timeout=300)
    assert "tensor-model-parallel size: 2" in tp2
    assert (
        abs(losses(tp2)[6] - full[6]) < 2e-2 and abs(validation(tp2)[6] - validation(uninterrupted["stdout"])[6]) < 2e-2
    )


def test_a_resume_that_changes_the_model_or_the_schedule_is_one_line_before_any_model(uninterrupted, cache):
    """``--load`` of the run's checkpoint with another ``--num-layers`` or ``--train-iters``:
    Megatron-LM asserts on both once the model is built (a traceback). Refused at start-up in
    one line naming the argument and both values (tests.helpers.bad_input runs the start-up);
    ``--override-opt_param-scheduler`` takes this run's schedule, as in Megatron-LM."""
    import json

    load = COMMON + ["--data-cache-path", str(cache), "--load", str(uninterrupted["ckpt"]), "--ckpt-step", "3"]
    cases = [load + ["--num-layers", "4"], load + ["--train-iters", "12"],
             load + ["--train-iters", "12", "--override-opt_param-scheduler"]]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.bad_input"], input=json.dumps(cases), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (layers, iters, overridden) = json.loads(proc.stdout)
    for (code, stderr, _), says in ((layers, ("--num-layers 4", "--num-layers 2")),
                                    (iters, ("--train-iters 12", "6"))):  # fmt: skip
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), stderr[-2000:]
        assert all(said in lines[0] for said in says) and "Traceback" not in stderr, lines[0]
    assert overridden[0] == 0, overridden[1][-2000:]


DEFAULT_FORMAT = [a for a in COMMON if a != "--dist-ckpt-optim-fully-reshardable"]
"""COMMON with Megatron-LM's default distributed-optimizer checkpoint format."""


FSDP_CHECKPOINTS = DEFAULT_FORMAT + MEGATRON_FSDP.split() + CLIPPING.split() + ["--muon-variance-reduction", "0.95"]
"""DEFAULT_FORMAT on Megatron-FSDP (ZeRO-3, --ckpt-format fsdp_dtensor) with QK-Clip, and
variance reduction (a state kept per matrix on its owner, scattered to the shards to save)."""
CONVERT = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_fsdp_checkpoint_resumes_and_moves_to_the_distributed_optimizer(cache, tmp_path):
    """A Muon run on Megatron-FSDP (DP2) saves fsdp_dtensor checkpoints (DCP, with our
    manifest). Iteration 3 resumes at TP2 x DP1 to reduction-order noise (DCP reshards the
    DTensors, the GLU halves split for it); a corrupted copy is refused before any read.
    Unconverted, a DistributedOptimizer run refuses it in one line naming the command;
    to-torch-dist resumes there (1e-4: DDP and Megatron-FSDP reduce in different orders) and
    to-fsdp-dtensor brings it back, where it resumes at DP2 bit for bit (which a plain resume
    would show again). (muon-to-adam on Megatron-FSDP:
    test_megatron_fsdp_adamw_checkpoint_resumes_and_switches_to_muon_and_back.)"""
    ckpt, ddp, back = (tmp_path / name for name in ("ckpt", "ddp", "back"))
    args = FSDP_CHECKPOINTS + ["--data-cache-path", str(cache)]
    full = run(TWO_RANKS + args + ["--save", str(ckpt), "--save-interval", "3"], timeout=300)
    assert (ckpt / "iter_0000003" / ".metadata").is_file() and (ckpt / "iter_0000003" / "integrity.json").is_file()
    want = losses(full)
    assert sorted(want) == list(range(1, 7)) and want[6] < want[1] - 1.0

    resume = args + ["--load", str(ckpt), "--ckpt-step", "3"]
    tp2 = run(TWO_RANKS + resume + ["--tensor-model-parallel-size", "2"], timeout=300)
    assert "tensor-model-parallel size: 2" in tp2
    assert losses(tp2)[4] == pytest.approx(want[4], rel=1e-4) and losses(tp2)[6] == pytest.approx(want[6], rel=1e-4)
    assert validation(tp2)[6] == pytest.approx(validation(full)[6], rel=1e-4)
    broken = tmp_path / "broken"
    shutil.copytree(ckpt / "iter_0000003", broken / "iter_0000003")
    data = broken / "iter_0000003" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = launch(TWO_RANKS + args + ["--load", str(broken), "--ckpt-step", "3"], timeout=300)
    assert proc.returncode != 0 and "__1_0.distcp" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "iteration        4/" not in proc.stdout

    ddp_args = (
        DEFAULT_FORMAT + CLIPPING.split() + ["--muon-variance-reduction", "0.95", "--data-cache-path", str(cache)]
    )
    unconverted = launch(PRETRAIN + ddp_args + ["--load", str(ckpt), "--ckpt-step", "3"], timeout=120)
    said = unconverted.stderr.strip().splitlines()
    assert unconverted.returncode == 2 and len(said) == 1 and "convert_checkpoint.py to-torch-dist" in said[0], said
    run(CONVERT + ["to-torch-dist", str(ckpt / "iter_0000003"), str(ddp)])
    assert (ddp / "iter_0000003" / "metadata.json").is_file() and (ddp / "iter_0000003" / "integrity.json").is_file()
    on_ddp = losses(run(TWO_RANKS + ddp_args + ["--load", str(ddp)], timeout=300))
    assert sorted(on_ddp) == [4, 5, 6], on_ddp
    assert on_ddp[4] == pytest.approx(want[4], rel=1e-4) and on_ddp[6] == pytest.approx(want[6], rel=1e-4)
    run(CONVERT + ["to-fsdp-dtensor", str(ddp), str(back)])
    # Both conversions exact and the resume exact: the uninterrupted run's losses, bit for bit.
    on_fsdp = run(TWO_RANKS + args + ["--load", str(back)], timeout=300)
    assert sorted(losses(on_fsdp)) == [4, 5, 6], on_fsdp[-2000:]
    assert all(losses(on_fsdp)[i] == want[i] for i in (4, 6)), (losses(on_fsdp), want)
    assert validation(on_fsdp)[6] == validation(full)[6]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_fsdp_adamw_checkpoint_resumes_and_switches_to_muon_and_back(cache, tmp_path):
    """Megatron's own AdamW on Megatron-FSDP with expert parallelism (tiny_moe_mla, EP2, bf16)
    saves fsdp_dtensor checkpoints (megatron-core 0.19.2's preprocessing hangs when a rank's
    shard of a parameter is empty: ours replaces it) and resumes bit for bit. A Muon run's
    start-up check refuses to load one (its momentum is missing), naming --no-load-optim;
    adam-to-muon converts it, and the Muon run resumes from the same weights (starting
    variance reduction's second moment at zero: the AdamW checkpoint has none). muon-to-adam
    converts the Muon run's checkpoint back, dense and expert groups alike, and AdamW goes on
    from Muon's weights."""
    from megatron_muon.megatron_lm.resume import check_optimizer_to_load

    ckpt, muon, muon_run, back = (tmp_path / name for name in ("ckpt", "muon", "muon_run", "back"))

    def moe(flags: List[str]) -> List[str]:
        model = ["tiny_moe_mla" if a == "tiny_gqa" else a for a in flags]
        return model + ["--expert-model-parallel-size", "2", "--bf16", "--data-cache-path", str(cache)]

    args = moe(DEFAULT_FORMAT + MEGATRON_FSDP.split() + ["--optimizer", "adam"])
    full = losses(run(TWO_RANKS + args + ["--save", str(ckpt), "--save-interval", "3"], timeout=300))
    resumed = losses(run(TWO_RANKS + args + ["--load", str(ckpt), "--ckpt-step", "3"], timeout=300))
    assert all(resumed[i] == full[i] for i in (4, 6)), (resumed, full)
    muon_args = moe(FSDP_CHECKPOINTS)
    # the start-up check reads fsdp_dtensor checkpoints too (it named the missing tensors from
    # inside Megatron-LM's load before); the one line it ends a launch with is
    # test_muon_load_of_an_adamw_run_says_how_to_switch's
    load = argparse.Namespace(load=str(ckpt), ckpt_step=3, no_load_optim=False, optimizer="muon",
                              muon_impl="megatron_muon")  # fmt: skip
    with pytest.raises(ValueError, match="holds AdamW state .*--no-load-optim"):
        check_optimizer_to_load(load)
    stats = run(CONVERT + ["adam-to-muon", str(ckpt / "iter_0000003"), str(muon), "--momentum", "exp_avg"])
    assert "'step': 3" in stats, stats
    on_muon = losses(
        run(TWO_RANKS + muon_args + ["--load", str(muon), "--save", str(muon_run), "--save-interval", "5"], timeout=300)
    )
    assert on_muon[4] == full[4] and on_muon[6] < on_muon[4], on_muon
    run(CONVERT + ["muon-to-adam", str(muon_run / "iter_0000005"), str(back)])
    on_adam = losses(run(TWO_RANKS + args + ["--load", str(back)], timeout=300))
    assert sorted(on_adam) == [6] and on_adam[6] == on_muon[6], (on_adam, on_muon)


@pytest.fixture(scope="module")
def adamw_runs(cache, tmp_path_factory) -> Dict[str, dict]:
    """The AdamW peer, uninterrupted, saving at 3 and 6 in Megatron-LM's default format, in
    fp32 and bf16."""
    out = {}
    for name, precision in (("fp32", []), ("bf16", ["--bf16"])):
        ckpt = tmp_path_factory.mktemp(f"adamw_{name}") / "ckpt"
        args = DEFAULT_FORMAT + precision + ["--optimizer", "adam", "--data-cache-path", str(cache)]
        out[name] = dict(
            args=args, ckpt=ckpt, stdout=run(PRETRAIN + args + ["--save", str(ckpt), "--save-interval", "3"])
        )
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adamw_baseline_resumes_exactly(adamw_runs, precision):
    """The AdamW peer (Megatron's DistributedOptimizer with torch's AdamW on the CPU), saved
    with Megatron-LM's default distributed-optimizer format, resumes as the uninterrupted
    run goes on: bit for bit at iterations 4, 5 and 6, as logged. It failed to load in fp32
    and resumed with a wrong Adam step (bias correction) in bf16."""
    full = adamw_runs[precision]
    resumed = run(PRETRAIN + full["args"] + ["--load", str(full["ckpt"]), "--ckpt-step", "3"])
    assert sorted(losses(resumed)) == [4, 5, 6], resumed[-2000:]
    assert all(losses(resumed)[i] == losses(full["stdout"])[i] for i in (4, 5, 6)), (losses(resumed), full["stdout"])
    assert validation(resumed)[6] == validation(full["stdout"])[6]


def test_muon_load_of_an_adamw_run_says_how_to_switch(adamw_runs, cache):
    """--optimizer muon --load of an AdamW run (Megatron-LM's default optimizer format) stops
    before any model is built, in one line, with the converter command that switches it (the
    whole walk-through runs in docs/checkpoints.md); --no-load-optim loads the weights alone."""
    load = DEFAULT_FORMAT + ["--data-cache-path", str(cache), "--load", str(adamw_runs["fp32"]["ckpt"])]
    proc = launch(PRETRAIN + load, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    ckpt = adamw_runs["fp32"]["ckpt"]
    assert f"convert_checkpoint.py adam-to-muon {ckpt} {ckpt}_muon`" in lines[0], lines[0]
    assert "holds AdamW state" in lines[0] and "--unverified-source" not in lines[0], lines[0]
    assert BUILT not in proc.stdout and " arguments " not in proc.stdout  # nor Megatron-LM's listing before it
    weights = run(PRETRAIN + load + ["--no-load-optim", "--train-iters", "7"])
    assert sorted(losses(weights)) == [7]


def test_wrong_load_with_exit_on_missing_checkpoint_writes_nothing(cache, tmp_path):
    save = tmp_path / "save"
    proc = launch(
        PRETRAIN
        + [
            "--recipe",
            "tiny_gqa",
            "--train-iters",
            "3",
            "--data-cache-path",
            str(cache),
            "--load",
            str(tmp_path / "typo"),
            "--exit-on-missing-checkpoint",
            "--save",
            str(save),
            "--save-interval",
            "1",
        ]
    )
    assert proc.returncode != 0
    assert not save.exists() or not any(save.iterdir()), list(save.iterdir())
    assert "iteration        1/" not in proc.stdout  # no training step ran


BAD_INPUT = [
    (["--recipe", "no_such_recipe"], "unknown recipe 'no_such_recipe'"),
    (["--recipe", "tiny_gqa", "--muon-tp-mode", "bogus"], "--muon-tp-mode: invalid choice: 'bogus'"),
    (["--recipe", "tiny_gqa", "--muon-momentum", "1.5"], "muon_momentum=1.5 is invalid; use a number in [0, 1)"),
    # Megatron-LM would report these as its min_lr <= lr check
    (["--recipe", "tiny_gqa", "--lr", "nan"], "--lr nan is invalid: use a finite number >= 0"),
    (["--recipe", "tiny_gqa", "--lr", "-0.01"], "--lr -0.01 is invalid: use a finite number >= 0"),
    # Megatron-core's Muon fails in fp32 in its step (megatron-core 0.19.2)
    (["--recipe", "tiny_gqa", "--muon-impl", "megatron"], "runs only with --bf16"),
    # Megatron-LM's checks of these are hidden with --qk-clip's (it wants transformer-engine)
    (
        ["--recipe", "tiny_gqa", "--qk-clip", "--qk-clip-threshold", "-5"],
        "--qk-clip-threshold -5.0 is invalid: QK-Clip scales down a head whose max attention logit exceeds it",
    ),
    (["--recipe", "tiny_gqa", "--qk-clip", "--qk-clip-threshold", "0"], "--qk-clip-threshold 0.0 is invalid"),
    (["--recipe", "tiny_gqa", "--qk-clip", "--qk-clip-alpha", "1.5"], "--qk-clip-alpha 1.5 is invalid"),
    # QK-Clip's refusals once the model is built (QKClip.from_model): q / k norms after the
    # projections (Qwen3's; MLA's latent norms are fine), a query group over two TP ranks
    (
        ["--recipe", "tiny_gqa", "--qk-clip", "--qk-layernorm"],
        "QK-Clip cannot bound the logits with qk_layernorm (--qk-layernorm)",
    ),
    (
        ["--recipe", "tiny_gqa", "--qk-clip", "--tensor-model-parallel-size", "4"],
        "QK-Clip cannot clip 2 query groups (num_query_groups, --num-query-groups) at tensor_model_parallel_size 4",
    ),
    # Megatron-LM's tokenizer build would fail on these (Hugging Face: "Repo id must be ...")
    (
        ["--recipe", "tiny_gqa", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/no/such/dir"],
        "--tokenizer-model /no/such/dir does not exist (--tokenizer-type HuggingFaceTokenizer): check the path",
    ),
    (
        ["--recipe", "tiny_gqa", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "no_vocab.json"],
        "--vocab-file no_vocab.json does not exist",
    ),
    # an unwritable --save (found when the job takes its lock, after Megatron-LM's validation)
    (
        ["--recipe", "tiny_gqa", "--save", "/proc/megatron_muon_no_save", "--save-interval", "1"],
        "/proc/megatron_muon_no_save cannot be written",
    ),
    # Megatron-LM divides by it once the model is built (the recipes set it)
    (
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--max-position-embeddings",
            "64",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "10",
            "--lr",
            "0.001",
        ],
        "--eval-interval is not set: Megatron-LM evaluates every --eval-interval iterations",
    ),  # fmt: skip
    # Megatron-core's QK-Clip scales the model weights, which the masters overwrite
    (["--recipe", "tiny_gqa", "--optimizer", "adam", "--qk-clip"], "--qk-clip with --optimizer adam"),
    # what the CPU path cannot run (Megatron would fail late or ignore the flag)
    pytest.param(
        ["--recipe", "tiny_gqa", "--transformer-impl", "transformer_engine"],
        "use --transformer-impl local",
        marks=NEEDS_NO_TE,
    ),
    pytest.param(
        ["--recipe", "tiny_moe", "--moe-token-dispatcher-type", "alltoall"],
        "use --moe-token-dispatcher-type allgather",
        marks=NEEDS_NO_GPU,
    ),
    # Megatron-core 0.19's local spec builds SequentialMLP whatever the flag (a GPU without TE too)
    (["--recipe", "tiny_moe", "--moe-grouped-gemm"], "--moe-grouped-gemm needs --transformer-impl transformer_engine"),
    pytest.param(
        ["--recipe", "tiny_gqa", "--attention-backend", "flash"],
        "--attention-backend flash needs a GPU",
        marks=NEEDS_NO_GPU,
    ),
    # Megatron-LM asserts these without a message once the model is built
    (
        ["--recipe", "tiny_gqa", "--train-iters", "2"],
        "--lr-warmup-iters 2 is not below the learning-rate decay's 2 iters (--train-iters)",
    ),
    (
        ["--recipe", "tiny_gqa", "--data-path", "{run}_no_such_prefix"],
        "_no_such_prefix.idx not found; give the prefix of a dataset that tools/preprocess_data.py wrote",
    ),
    (["--recipe", "tiny_gqa", "--data-path", "0.5", "{run}_a", "0.5", "{run}_b"], "run_a.bin and "),
    # refused before the model is built (the optimizer's own check comes after)
    (
        ["--recipe", "tiny_gqa", *MEGATRON_FSDP.split(), "--muon-cpu-offload"],
        "does not offload to the CPU on Megatron-FSDP",
    ),
    (["--recipe", "tiny_gqa", "--muon-step-overlap", "forward"], "needs --overlap-param-gather"),
    # the rest of the support matrix (megatron_muon/support.py), each refusal once
    (["--recipe", "tiny_gqa", "--optimizer", "dist_muon"], "--optimizer dist_muon is deprecated"),
    (["--recipe", "tiny_gqa", "--use-precision-aware-optimizer"], "does not support use_precision_aware_optimizer"),
    (
        ["--recipe", "tiny_gqa", "--reuse-grad-buf-for-mxfp8-param-ag"],
        "does not support reuse_grad_buf_for_mxfp8_param_ag",
    ),
    (
        ["--recipe", "tiny_gqa", "--num-distributed-optimizer-instances", "2"],
        "needs num_distributed_optimizer_instances=1",
    ),
    (["--recipe", "tiny_gqa", "--optimizer-cpu-offload"], "optimizer_cpu_offload=True needs muon_cpu_offload=True"),
    (["--recipe", "tiny_gqa", "--use-torch-fsdp2"], "does not support Torch FSDP2"),
    (["--recipe", "tiny_gqa", "--dump-param-to-param-group-map", "m.json"], "--dump-param-to-param-group-map"),
    (
        ["--recipe", "tiny_gqa", *MEGATRON_FSDP.split(), "--megatron-fsdp-main-params-dtype", "auto"],
        "Megatron-FSDP without main weights",
    ),
    (["--recipe", "tiny_gqa", *MEGATRON_FSDP.split(), "--async-save"], "saves fsdp_dtensor checkpoints synchronously"),
    (["--recipe", "tiny_gqa", "--async-save"], "saves synchronously on the CPU"),
    (["--recipe", "tiny_gqa", *MEGATRON_FSDP.split(), "--muon-step-overlap", "forward"], "not on Megatron-FSDP"),
    (["--recipe", "tiny_gqa", "--muon-step-overlap", "later"], "muon_step_overlap='later' is not supported"),
    (
        ["--recipe", "tiny_gqa", "--muon-step-overlap", "none", "--muon-step-overlap-side-stream"],
        "muon_step_overlap_side_stream=True needs the step in the next forward",
    ),
    # optional packages Megatron-LM imports only once it runs (tests.helpers.bad_input hides them)
    (
        ["--recipe", "tiny_gqa", "--wandb-project", "p", "--wandb-save-dir", "w", "--tensorboard-dir", "t"],
        "--wandb-project needs the wandb package, which is not installed: pip install 'megatron-muon[ecosystem]'",
    ),
    (
        ["--recipe", "tiny_gqa", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "m"],
        "--tokenizer-type HuggingFaceTokenizer needs the transformers package",
    ),
    # (a tokenizer file that exists: the package is what is missing)
    (
        ["--recipe", "tiny_gqa", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", "README.md"],
        "the tiktoken package",
    ),
    # what Megatron-LM's W&B writer needs and does not check
    (["--recipe", "tiny_gqa", "--wandb-project", "p", "--tensorboard-dir", "t"], "add --wandb-save-dir DIR"),
    (["--recipe", "tiny_gqa", "--wandb-project", "p", "--wandb-save-dir", "w"], "add --tensorboard-dir DIR"),
    # a bare assert of Megatron-LM's validation: its source line names the argument
    (
        ["--recipe", "tiny_gqa", "--save", "ckpt_never_written"],
        "check `assert args.save_interval is not None` failed",
    ),
    # a --save holding a run, and no checkpoint to --load: Megatron-LM would train from scratch over it
    (["--recipe", "tiny_gqa", "--save", "{run}", "--save-interval", "1"], "holds a run but no --load is given"),
    (
        ["--recipe", "tiny_gqa", "--load", "{run}_typo", "--save", "{run}", "--save-interval", "1"],
        "_typo holds no checkpoint: resume it with --load",
    ),
    # a --load that names no checkpoint (a typo): Megatron-LM would train from scratch
    (
        ["--recipe", "tiny_gqa", "--load", "{run}_typo", "--save", "{run}_new", "--save-interval", "1"],
        "_typo holds no checkpoint (no latest_checkpointed_iteration.txt, no iterations): check the path",
    ),
    (["--recipe", "tiny_gqa", "--load", "{run}_typo"], "_typo holds no checkpoint"),
]


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory) -> Dict[str, List]:
    """Every case of BAD_INPUT through the main job's start-up, in one process
    (tests.helpers.bad_input), ``{run}`` standing for a directory that holds a run (its
    files must come through unchanged)."""
    import json

    held = tmp_path_factory.mktemp("held") / "run"
    (held / "iter_0000003").mkdir(parents=True)
    (held / "iter_0000003" / "common.pt").write_bytes(b"weeks of training")
    (held / "latest_checkpointed_iteration.txt").write_text("3")
    before = {p: p.read_bytes() for p in held.rglob("*") if p.is_file()}
    argvs = [case.values[0] if hasattr(case, "values") else case[0] for case in BAD_INPUT]
    given = [[a.replace("{run}", str(held)) for a in argv] for argv in argvs]
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.bad_input"], input=json.dumps(given), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in held.rglob("*") if p.is_file()} == before
    return {" ".join(argv): result for argv, result in zip(argvs, json.loads(proc.stdout))}


@pytest.mark.parametrize("argv, says", BAD_INPUT)
def test_bad_input_one_line_exit_2_before_any_model(bad_input_results, argv, says):
    """One line on stderr, exit code 2, and no listing of Megatron-LM's arguments before it
    (a bad --muon-* value is found after Megatron-LM's validation, which ends with it)."""
    code, stderr, stdout = bad_input_results[" ".join(argv)]
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("pretrain_gpt.py: error: ") and says in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr and " arguments " not in stdout, stdout[:2000]


def test_bad_input_as_a_user_launches_it():
    proc = launch(PRETRAIN + ["--recipe", "tiny_gqa", "--lr", "nan"], timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == ["pretrain_gpt.py: error: --lr nan is invalid: use a finite number >= 0"]
    assert "Traceback" not in proc.stderr and BUILT not in proc.stdout


def test_exclude_pattern_that_matches_nothing_is_one_line(cache):
    """A --muon-exclude-patterns entry that names no parameter (a typo would leave the
    matrices it meant on Muon): refused in one line, exit code 2, once the model is built
    (the names are the model's), before any step."""
    proc = launch(PRETRAIN + COMMON + ["--data-cache-path", str(cache), "--muon-exclude-patterns",
                                       "*.linear_proj.weight", "*.linear_prj.weight"], timeout=200)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: --muon-exclude-patterns '*.linear_prj.weight' matches no parameter of the model "
        "(fnmatch on names such as 'decoder.layers.0.input_layernorm.weight'): correct the pattern or drop it"
    ), proc.stderr[-3000:]
    assert not losses(proc.stdout)


def test_train_samples_overrides_the_recipes_iterations(cache):
    """A recipe pins --train-iters and an iteration-based warmup; --train-samples on the
    command line counts samples instead (Megatron-LM takes one or the other): 24 samples at
    the recipe's global batch of 8 are 3 iterations, the warmup is given in samples."""
    stdout = run(
        PRETRAIN
        + ["--recipe", "tiny_gqa", "--train-samples", "24", "--eval-iters", "0", "--data-cache-path", str(cache)]
    )
    assert sorted(losses(stdout)) == [1, 2, 3], stdout[-2000:]
    assert re.search(r"lr_warmup_samples \.+ 16$", stdout, re.M) and re.search(r"train_samples \.+ 24$", stdout, re.M)


def test_help_lists_every_flag():
    """``--help`` rc 0 with Megatron-LM's flags and ours (megatron-core 0.19.2's own help
    text for one flag has a bare "%", which made argparse fail before anything was shown);
    ``-h`` through the console script (setup.py's ``megatron-muon-pretrain``, which runs
    tools/pretrain_gpt.py) too."""
    proc = launch(PRETRAIN + ["--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for option in ("--moe-paged-stash-buffer-size-factor-cuda", "--muon-impl", "--recipe", "--muon-ns-max-ranks"):
        assert option in proc.stdout, option
    code = (
        "import sys; from megatron_muon.megatron_lm.launch import console_main; "
        "sys.argv = ['megatron-muon-pretrain', '-h']; sys.exit(console_main())"
    )
    console = launch([sys.executable, "-c", code], timeout=120)
    assert console.returncode == 0 and "--muon-impl" in console.stdout, console.stderr[-2000:]


def test_megatron_lm_example_launch_line(tmp_path):
    """Flags as Megatron-LM's GPT example scripts write them (mcore models, sample-based
    schedule, selective recompute, NullTokenizer, mock data), tiny sizes, with its optimizer
    offload flags; plus --optimizer muon and --muon-cpu-offload (bf16: the Muon masters go
    to the CPU too)."""
    stdout = run(
        PRETRAIN
        + [
            "--use-mcore-models",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--max-position-embeddings",
            "64",
            "--attention-backend",
            "auto",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-samples",
            "24",
            "--lr-decay-samples",
            "16",
            "--lr-warmup-samples",
            "4",
            "--lr",
            "6.0e-3",
            "--min-lr",
            "6.0e-4",
            "--lr-decay-style",
            "cosine",
            "--clip-grad",
            "1.0",
            "--weight-decay",
            "0.1",
            "--adam-beta1",
            "0.9",
            "--adam-beta2",
            "0.95",
            "--init-method-std",
            "0.006",
            "--recompute-activations",
            "--bf16",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1000",
            "--mock-data",
            "--split",
            "949,50,1",
            "--log-interval",
            "1",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--optimizer-cpu-offload",
            "--use-precision-aware-optimizer",
            "--optimizer",
            "muon",
            "--use-distributed-optimizer",
            "--muon-cpu-offload",
        ]
    )
    assert BUILT in stdout and DONE in stdout and sorted(losses(stdout)) == list(range(1, 7))


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_non_finite_step_exits_non_zero_and_latest_stays_finite(cache, tmp_path, optimizer):
    """A learning rate that blows the weights up: Megatron-LM's NaN check
    (--check-for-nan-in-loss-and-grad, on by default) stops the job with a non-zero code;
    every checkpoint on disk, "latest" included, is finite and verifies, and the last one
    is not saved again when the job stops (every iteration saves)."""
    ckpt = tmp_path / "ckpt"
    proc = launch(
        PRETRAIN
        + [
            "--recipe",
            "tiny_moe",
            "--optimizer",
            optimizer,
            "--lr",
            "1e30",
            "--min-lr",
            "1e29",
            "--train-iters",
            "8",
            "--data-cache-path",
            str(cache),
            "--eval-iters",
            "0",
            "--save",
            str(ckpt),
            "--save-interval",
            "1",
        ]
    )
    assert proc.returncode != 0 and "found NaN" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert latest < 8 and (ckpt / f"iter_{latest:07d}").is_dir()
    assert f"iter_{latest:07d} already holds this iteration" in proc.stdout, proc.stdout[-3000:]
    facts = checkpoint_facts(sorted(ckpt.glob("iter_*")))
    assert all(f["manifest"] and f["finite"] for f in facts.values()), facts


def test_a_skipped_step_leaves_the_router_expert_bias(cache, tmp_path):
    """Without Megatron-LM's NaN check the job goes on and skips every non-finite step; the
    router's expert bias (tiny_moe_mla balances with it) stays where the last taken step
    left it, as every other weight does."""
    ckpt = tmp_path / "ckpt"
    stdout = run(short_run("tiny_moe_mla", cache, "--lr", "1e30", "--min-lr", "1e29", "--no-check-for-nan-in-loss-and-grad",
                           "--save", str(ckpt), "--save-interval", "1", iterations=5))  # fmt: skip
    skipped = [int(m) for m in re.findall(r"number of skipped iterations:\s+(\d+)", stdout)]
    assert skipped[-2:] == [1, 1], stdout[-3000:]  # the last two iterations were skipped
    facts = checkpoint_facts([ckpt / f"iter_{i:07d}" for i in (3, 4, 5)])
    biases = [f["expert_bias"] for f in facts.values()]
    assert biases[0] and biases[1] == biases[2], biases


def test_a_launcher_killed_while_its_ranks_import_leaves_no_rank(tmp_path):
    """SIGKILL of torchrun once both ranks have started, while they still import torch and
    Megatron-core (seconds): within 2 s no rank is left, since each ties itself to its
    launcher before those imports."""
    import signal
    import time

    tag = f"kill-at-start-{os.getpid()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", MUON_TEST_JOB=tag)
    cmd = TWO_RANKS + ["--recipe", "tiny_gqa", "--train-iters", "2", "--save", str(tmp_path / "ckpt")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip

    def ranks() -> List[int]:
        found = []
        for pid in tagged_processes(tag):
            try:
                if any(v.startswith(b"RANK=") for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                    found.append(pid)
            except OSError:  # it ended meanwhile
                continue
        return found

    try:
        deadline = time.time() + 60
        while len(ranks()) < 2:
            assert proc.poll() is None and time.time() < deadline, "the ranks did not start"
            time.sleep(0.02)
        time.sleep(1.0)  # past the script's first lines, inside the imports (seconds more)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 2
        while ranks() and time.time() < deadline:
            time.sleep(0.05)
        assert not ranks(), "ranks still running 2 s after their launcher was killed"
        assert not (tmp_path / "ckpt").exists()  # killed before they got to --save
    finally:
        kill_tagged(tag)


def _kill_during_saves(cmd: List[str], tracker: Path, tag: str, after: int, kill: str) -> List[int]:
    """Start ``cmd`` (torchrun, in a session of its own as a terminal or a scheduler starts
    it); once the tracker names iteration ``after`` or later, SIGKILL at a random moment
    (every iteration saves) torchrun's PID (``kill="launcher"``) or its process group
    (``kill="group"``), as ``kill -9`` or the OOM killer does: torchrun starts each rank in a
    session of its own, so neither reaches the ranks. Returns whatever of the job is still
    alive 10 s later; everything of it is killed afterwards either way."""
    import random
    import signal
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", MUON_TEST_JOB=tag)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 180
        while not (tracker.is_file() and tracker.read_text().strip().isdigit() and int(tracker.read_text()) >= after):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:] if proc.stderr else ""
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 0.5))
        os.killpg(proc.pid, signal.SIGKILL) if kill == "group" else os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while tagged_processes(tag) and time.time() < deadline:
            time.sleep(0.2)
        return tagged_processes(tag)
    finally:
        kill_tagged(tag)


@pytest.mark.timeout(600)
def test_killed_job_leaves_no_process_and_resumes_from_its_tracker(cache, tmp_path):
    """SIGKILL of a two-rank job's launcher, its PID and then its process group (neither
    reaches the ranks, which torchrun starts in sessions of their own), at random moments
    while it saves every iteration: within 10 s none of its processes is left (each rank
    dies with its launcher, checkpoint writers with their rank) and the tracker always names
    a complete checkpoint, which the next job resumes from, taking over the dead job's lock
    on --save. With an empty tracker the next job resumes from the newest iteration that
    verifies. With a byte flipped it stops the job with one line on rank 0 (another
    vocabulary padding and a deleted manifest are refused alike: tests/dist/test_faults.py
    loads them through Megatron-LM's own load path)."""
    ckpt = tmp_path / "ckpt"
    job = TWO_RANKS + "--recipe tiny_gqa --train-iters 60 --lr-warmup-iters 0 --eval-iters 0".split() + [
        "--data-cache-path", str(cache), "--save", str(ckpt), "--save-interval", "1"]  # fmt: skip
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    for round_, (after, kill) in enumerate(((2, "launcher"), (5, "group"))):
        left = _kill_during_saves(
            job + (["--load", str(ckpt)] if round_ else []), tracker, f"kill-{os.getpid()}-{round_}", after, kill
        )
        assert not left, f"round {round_} (kill the {kill}): processes of the killed job still running: {left}"
        latest = int(tracker.read_text())
        assert (ckpt / f"iter_{latest:07d}" / "integrity.json").is_file()
    proc = launch(job + ["--exit-interval", str(latest + 1), "--load", str(ckpt)], timeout=300)
    resumed = proc.stdout
    assert proc.returncode == 0 and "took over" in proc.stderr and "has ended" in proc.stderr, proc.stderr[-3000:]
    assert f"at iteration {latest}" in resumed and sorted(losses(resumed)) == [latest + 1], resumed[-2000:]
    # An empty tracker (what Megatron-LM's own write left when killed): resumes from the
    # newest iteration that verifies, and says so.
    tracker.write_text("")
    again = run(job + ["--exit-interval", str(latest + 2), "--load", str(ckpt)], timeout=300)
    assert f"resuming from iter_{latest + 1:07d}, the newest iteration that verifies" in again, again[-3000:]
    assert sorted(losses(again)) == [latest + 2] and int(tracker.read_text()) == latest + 2
    newest = ckpt / f"iter_{latest + 2:07d}"
    data = sorted(newest.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = launch(job + ["--exit-interval", str(latest + 3), "--load", str(ckpt)], timeout=300)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]
    # one line, no traceback of a rank (torchrun still reports the failed ranks its own way)
    assert f"{data.name}: contents changed" in ours[0] and "CheckpointIntegrityError" not in proc.stderr, proc.stderr[
        -3000:
    ]


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def test_preprocess_then_data_path_and_small_corpus_split(cache, tmp_path):
    """tools/preprocess_data.py -> --data-path trains (tiny_moe); the same small corpus with
    Megatron-LM's default split (969,30,1: no test documents) fails with the fix, not a hang."""
    import json

    src = tmp_path / "corpus.jsonl"
    with open(src, "w") as f:
        for i in range(120):
            f.write(
                json.dumps({"text": f"Record {i}: " + "pack my box with five dozen liquor jugs. " * (1 + i % 4)}) + "\n"
            )
    run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(src),
            "--json-keys",
            "text",
            "--output-prefix",
            str(tmp_path / "data" / "corpus"),
            "--append-eod",
        ]
    )
    prefix = str(tmp_path / "data" / "corpus_text_document")
    common = PRETRAIN + [
        "--recipe",
        "tiny_moe",
        "--train-iters",
        "8",
        "--data-path",
        prefix,
        "--data-cache-path",
        str(cache),
        "--eval-iters",
        "1",
        "--eval-interval",
        "8",
    ]
    stuck = launch(common, timeout=150)
    assert stuck.returncode != 0 and "the test split of" in stuck.stderr and "--split" in stuck.stderr
    trained = losses(run(common + ["--split", "90,8,2"]))
    assert sorted(trained) == list(range(1, 9)) and trained[8] < trained[1] - 0.5


# ---------------------------------------------------------------------------------------
# Recipes, read by Megatron-LM's parser and validation
# ---------------------------------------------------------------------------------------


def _read_recipes(recipe_file: str) -> dict:
    """In a fresh process: recipes and overrides through Megatron-LM's parser / validation."""
    from megatron_muon.megatron_lm.integration import muon_config_from_megatron
    from megatron_muon.megatron_lm.launch import validated_args
    from tools.bench import sizing

    out: dict = {}
    a = validated_args(
        [
            "--recipe",
            "tiny_gqa",
            "--num-layers",
            "3",
            "--lr",
            "0.02",
            "--no-muon-nesterov",
            "--muon-tp-mode",
            "distributed",
            "--muon-ns-dtype",
            "fp32",
        ],
        world_size=2,
    )
    cfg = muon_config_from_megatron(a)
    out["tiny_gqa"] = dict(
        layers=a.num_layers,
        lr=a.lr,
        hidden=a.hidden_size,
        swiglu=a.swiglu,
        dp=a.data_parallel_size,
        nesterov=cfg.muon_nesterov,
        tp_mode=cfg.muon_tp_mode,
        ns_dtype=str(cfg.muon_ns_dtype),
        optimizer=a.optimizer,
        groups=a.num_query_groups,
    )
    # The step-overlap mode 'auto' chooses is in the arguments (and so in the run's record).
    overlap = ["--recipe", "tiny_gqa", "--overlap-grad-reduce", "--overlap-param-gather"]
    out["step_overlap"] = [validated_args(overlap + more).muon_step_overlap for more in ([], ["--muon-cpu-offload"])]
    a = validated_args(["--recipe", recipe_file])
    out["file"] = dict(nesterov=a.muon_nesterov, bias=a.add_bias_linear, data_path=a.data_path, ffn=a.ffn_hidden_size)
    for name, (world, _, _) in REAL.items():
        a = validated_args(["--recipe", name], world_size=world)
        count = sizing.count_parameters(a, a.vocab_size)
        out[name] = (count.total, count.active)
    return out


def test_recipes_through_megatron_lm_arguments(tmp_path):
    from megatron_muon.testing import run_distributed

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "num_layers: 2\nhidden_size: 32\nnum-attention-heads: 2\nseq_length: 16\nmax-position-embeddings: 16\n"
        "micro_batch_size: 2\ntrain_iters: 5\neval_interval: 5\nlr: 1.0e-3\nmuon_nesterov: false\nadd_bias_linear: false\n"
        "data-path: [a, b]\nsplit: 90,8,2\n"
    )
    got = run_distributed(_read_recipes, 1, str(recipe), timeout_s=200)[0]
    assert got["tiny_gqa"] == dict(
        layers=3,
        lr=0.02,
        hidden=64,
        swiglu=True,
        dp=2,
        nesterov=False,
        tp_mode="exact",
        ns_dtype="torch.float32",
        optimizer="muon",
        groups=2,
    )
    assert got["file"] == dict(nesterov=False, bias=False, data_path=["a", "b"], ffn=128)
    assert got["step_overlap"] == ["forward", "none"]
    for name, (_, total, active) in REAL.items():
        count_total, count_active = got[name]
        assert abs(count_total / total - 1) < 0.01, f"{name}: {count_total} vs published total {total / 1e9} B"
        if active is not None:
            assert abs(count_active / active - 1) < 0.03, f"{name}: {count_active} vs published active {active / 1e9} B"


# ---------------------------------------------------------------------------------------
# The CPU patches of Megatron-LM's training code, one by one
# ---------------------------------------------------------------------------------------


def _cpu_patches() -> dict:
    import os
    import subprocess as sp

    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    from megatron_muon.megatron_lm import cpu

    max_conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    on_cpu = cpu.install()
    calls = []
    real_run, sp.run = sp.run, lambda *a, **k: calls.append(a) or real_run(["true"])
    try:
        dataset_utils.compile_helpers()  # the wheel ships helpers_cpp: no `make`
    finally:
        sp.run = real_run
    return dict(
        on_cpu=on_cpu,
        make_calls=len(calls),
        helpers=cpu.helpers_compiled(),
        init_kwargs=dict(getattr(training.initialize_megatron, "keywords", {})),
        arch=arguments.get_device_arch_version(),
        max_conn_changed=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != max_conn,
        idempotent=cpu.install() is True and training.initialize_megatron.func.__name__ == "initialize_megatron",
    )


def test_cpu_patches_each_do_their_one_thing():
    import torch

    from megatron_muon.testing import run_distributed

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    got = run_distributed(_cpu_patches, 1, timeout_s=120)[0]
    assert got == dict(
        on_cpu=True,
        make_calls=0,
        helpers=True,
        init_kwargs={"allow_no_cuda": True},
        arch=0,
        max_conn_changed=False,  # validate_args sets it, unless Megatron-FSDP is on (it requires it unset or > 1)
        idempotent=True,
    )


PLAIN_FUSED = """
import sys, torch
from megatron_muon.megatron_lm import cpu
compile_ = torch.compile
with cpu.plain_fused_functions():
    from megatron.core import jit
def f(x):
    return x
print(jit.jit_fuser(f) is f, torch.compile is compile_, "torch._inductor" in sys.modules)
"""


def test_megatron_core_imported_for_the_cpu_keeps_its_fused_functions_plain():
    """On the CPU path (dynamo disabled) Megatron-core's import-time ``torch.compile``
    decorators return the function itself, so torch's inductor is never imported (about 2 s
    a process); ``torch.compile`` is torch's again afterwards, and
    ``MEGATRON_MUON_CPU_COMPILE=1`` keeps Megatron-core's compiled functions."""
    plain = subprocess.run([sys.executable, "-c", PLAIN_FUSED], env=job_env(), capture_output=True, text=True)
    assert plain.stdout.split() == ["True", "True", "False"], plain.stderr[-2000:]
    compiled = subprocess.run(
        [sys.executable, "-c", PLAIN_FUSED], env=job_env(MEGATRON_MUON_CPU_COMPILE="1"), capture_output=True, text=True
    )
    assert compiled.stdout.split() == ["False", "True", "True"], compiled.stderr[-2000:]
