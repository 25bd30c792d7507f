"""``tools/pretrain_gpt.py`` / ``megatron_muon.megatron_lm``: the Megatron-LM-compatible driver.

End to end on the CPU (subprocesses, as a user launches it): one rank on the stdlib corpus
(loss falls; save at 15 and resume bitwise), two ranks under ``torchrun`` with TP=2,
``--data-path`` training on a dataset written by ``tools/preprocess_data.py``. In process:
the parser (generated ``--muon-*`` flags, recipes, errors), the checkpoint publication
protocol, every recipe (tiny ones built and stepped in a spawned rank, real-size ones
checked by Megatron's ``TransformerConfig`` and against their published sizes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = [sys.executable, str(ROOT / "tools" / "pretrain_gpt.py")]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
TINY = ["tiny_gqa", "tiny_moe", "tiny_moe_mla"]
REAL = {  # recipe: (world size that fits its layout, published total / active parameters)
    "llama3_8b": (8, 8.03e9, None),
    "qwen3_30b_a3b": (8, 30.5e9, 3.3e9),
    "moonlight_16b_a3b": (8, 15.29e9 + 163840 * 2048 * 2, 2.24e9 + 163840 * 2048 * 2),  # published w/o embeddings
    "deepseek_v3": (1024, 671e9, 37e9),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache (stdlib corpus, dataset indices) for every run of this module."""
    return tmp_path_factory.mktemp("cache")


def run(cmd: List[str], timeout: int = 150) -> str:
    # On the CPU everywhere (CI has no GPU; two ranks on a one-GPU machine would share it).
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def losses(stdout: str) -> Dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(stdout)}


def metrics(path: Path) -> Dict[tuple, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["iteration"], r.get("split")): r for r in rows}


def assert_falls(loss: Dict[int, float], by: float) -> None:
    its = sorted(loss)
    first = sum(loss[i] for i in its[:3]) / 3
    last = sum(loss[i] for i in its[-3:]) / 3
    assert last < first - by, f"loss did not fall by {by}: first {first:.3f}, last {last:.3f} ({loss})"


# ---------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_rank(cache, tmp_path_factory):
    """30 iterations of tiny_gqa on the stdlib corpus, one rank, saving at 15 and 30."""
    out = tmp_path_factory.mktemp("single")
    stdout = run(PRETRAIN + [
        "--recipe", "tiny_gqa", "--train-iters", "30", "--data-cache-path", str(cache),
        "--save", str(out / "ckpt"), "--save-interval", "15", "--metrics-file", str(out / "full.jsonl"),
        "--eval-interval", "15", "--eval-iters", "2",
        # Pads the vocabulary alike at TP1 and TP2 (test_reshard_on_resume_tp1_to_tp2).
        "--make-vocab-size-divisible-by", "256",
    ])
    return dict(stdout=stdout, dir=out)


def test_single_rank_stdlib_loss_falls(single_rank):
    loss = losses(single_rank["stdout"])
    assert sorted(loss) == list(range(1, 31))
    assert_falls(loss, by=1.0)
    assert "standard library" in single_rank["stdout"]
    assert "validation loss at iteration 15" in single_rank["stdout"]
    assert (single_rank["dir"] / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"


def test_readme_first_command():
    """README's first command, after its install step, as written (this venv's bin for .venv/bin):
    the validation loss falls from its start to well below."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"```bash\n(python3.12 -m venv .*?)\n```", readme).group(1)
    train = command.split(" && ")[-1].replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    stdout = run(train.split(), timeout=300)
    valid = [float(v) for v in re.findall(r"validation loss at iteration \d+ \| lm loss value: ([0-9.E+-]+)", stdout)]
    assert len(valid) >= 2 and valid[-1] < valid[0] - 2.0, valid


def test_resume_continues_bitwise(single_rank, cache):
    """Load iteration 15 (same layout): iterations 16..30 repeat the uninterrupted run exactly."""
    out = single_rank["dir"]
    stdout = run(PRETRAIN + [
        "--recipe", "tiny_gqa", "--train-iters", "30", "--data-cache-path", str(cache),
        "--load", str(out / "ckpt"), "--ckpt-step", "15", "--metrics-file", str(out / "resumed.jsonl"),
        "--eval-interval", "15", "--eval-iters", "2", "--make-vocab-size-divisible-by", "256",
    ])
    assert "loaded checkpoint of iteration 15" in stdout
    assert sorted(losses(stdout)) == list(range(16, 31))
    full, resumed = metrics(out / "full.jsonl"), metrics(out / "resumed.jsonl")
    assert len(resumed) >= 16  # 15 iterations + validation at 30 (+ end of training)
    for key, row in resumed.items():
        assert full[key] == row, f"{key}: resumed {row} != uninterrupted {full[key]}"


def test_reshard_on_resume_tp1_to_tp2(single_rank, cache):
    """The default torch_dist checkpoint of the one-rank run resumes under torchrun with TP=2:
    iterations 16..30 follow the uninterrupted run (to reduction-order noise)."""
    out = single_rank["dir"]
    assert (out / "ckpt" / "iter_0000015" / ".metadata").is_file()  # torch_dist by default with muon
    stdout = run([
        TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0", *PRETRAIN[1:],
        "--recipe", "tiny_gqa", "--train-iters", "30", "--tensor-model-parallel-size", "2",
        "--data-cache-path", str(cache), "--load", str(out / "ckpt"), "--ckpt-step", "15",
        "--metrics-file", str(out / "tp2.jsonl"), "--eval-interval", "15", "--eval-iters", "2",
        "--make-vocab-size-divisible-by", "256",
    ], timeout=200)
    assert "resharded from" in stdout and "loaded checkpoint of iteration 15" in stdout
    full, tp2 = metrics(out / "full.jsonl"), metrics(out / "tp2.jsonl")
    steps = [k for k in tp2 if k[1] is None and k[0] > 15]
    assert len(steps) == 15
    for key in steps:
        assert abs(tp2[key]["lm loss"] - full[key]["lm loss"]) < 2e-2, (key, tp2[key], full[key])


def test_torch_format_resume_bitwise(cache, tmp_path):
    """--ckpt-format torch: per-rank files, same-layout resume, bit for bit."""
    common = PRETRAIN + ["--recipe", "tiny_gqa", "--train-iters", "6", "--data-cache-path", str(cache),
                         "--ckpt-format", "torch", "--eval-iters", "0"]
    run(common + ["--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--metrics-file", str(tmp_path / "full.jsonl")])
    assert (tmp_path / "ckpt" / "iter_0000003" / "rank_00000.pt").is_file()
    stdout = run(common + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3", "--metrics-file", str(tmp_path / "resumed.jsonl")])
    assert "loaded checkpoint of iteration 3" in stdout
    full, resumed = metrics(tmp_path / "full.jsonl"), metrics(tmp_path / "resumed.jsonl")
    assert [k for k in resumed if k[0] > 3] and all(full[k] == row for k, row in resumed.items())


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    """The publication protocol: nothing is visible until the directory is renamed and the
    tracker replaced; a crash before leaves the previous checkpoint as the latest."""
    from megatron_muon.megatron_lm import checkpointing as C

    root = tmp_path / "ckpt"
    for it in (10, 20):
        tmp = root / f"iter_{it:07d}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "rank_00000.pt").write_bytes(b"x")
        assert C.latest_iteration(root) == (None if it == 10 else 10)
        C.publish(tmp, C.iteration_dir(root, it), root, it)
        assert C.latest_iteration(root) == it
    # A save of 30 that died after writing part of its files:
    crashed = root / "iter_0000030.tmp"
    crashed.mkdir()
    (crashed / "rank_00000.pt.partial").write_bytes(b"half")
    assert C.latest_iteration(root) == 20 and C.rank_file(C.iteration_dir(root, 20), 0).is_file()
    # Re-saving an existing iteration swaps it in whole.
    tmp = root / "iter_0000020.tmp"
    tmp.mkdir()
    (tmp / "rank_00000.pt").write_bytes(b"new")
    C.publish(tmp, C.iteration_dir(root, 20), root, 20)
    assert C.rank_file(C.iteration_dir(root, 20), 0).read_bytes() == b"new"
    assert not list(root.glob("*.old-*"))


def test_torchrun_two_ranks_tensor_parallel(cache, tmp_path):
    stdout = run([
        TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0", *PRETRAIN[1:],
        "--recipe", "tiny_gqa", "--train-iters", "20", "--tensor-model-parallel-size", "2",
        "--data-cache-path", str(cache), "--eval-iters", "1", "--eval-interval", "20",
    ], timeout=200)
    assert "2 rank(s)" in stdout and "TP=2" in stdout
    loss = losses(stdout)
    assert sorted(loss) == list(range(1, 21))
    assert_falls(loss, by=1.0)


def test_preprocess_then_data_path(cache, tmp_path):
    from megatron_muon.megatron_lm import preprocess

    src = tmp_path / "corpus.jsonl"
    with open(src, "w") as f:
        for i in range(120):
            f.write(json.dumps({"text": f"Record {i}: " + "pack my box with five dozen liquor jugs. " * (1 + i % 4)}) + "\n")
    counts = preprocess.preprocess(preprocess.build_parser().parse_args([
        "--input", str(src), "--json-keys", "text", "--output-prefix", str(tmp_path / "data" / "corpus"), "--append-eod",
    ]))
    prefix = str(tmp_path / "data" / "corpus_text_document")
    assert counts == {prefix: 120}
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert len(ds) == 120 and bytes(ds[0][:-1].tolist()).decode().startswith("Record 0: pack")
    stdout = run(PRETRAIN + [
        "--recipe", "tiny_gqa", "--train-iters", "12", "--data-path", prefix, "--split", "90,10,0",
        "--data-cache-path", str(cache), "--eval-iters", "1", "--eval-interval", "12",
    ])
    assert f"indexed datasets ['{prefix}']" in stdout
    assert_falls(losses(stdout), by=0.5)


# ---------------------------------------------------------------------------------------
# Arguments and recipes
# ---------------------------------------------------------------------------------------


def test_generated_muon_flags_cover_muon_config():
    from megatron_muon import MuonConfig
    from megatron_muon.megatron_lm import arguments, muon_args

    parser = arguments.build_parser()
    options = {o for a in parser._actions for o in a.option_strings}
    fields = [f.name for f in dataclasses.fields(MuonConfig) if f.name.startswith("muon_")]
    skipped = set(muon_args.non_cli_fields())
    assert skipped <= {"muon_param_filter"}, f"fields without a command-line form: {skipped}"
    for name in fields:
        if name not in skipped:
            assert muon_args.flag_name(name) in options, f"no flag for MuonConfig.{name}"


def test_muon_flags_reach_muon_config():
    from megatron_muon.megatron_lm import arguments, optim

    args = arguments.parse_args([
        "--recipe", "tiny_gqa", "--no-muon-nesterov", "--muon-ns-dtype", "fp32", "--muon-comm-dtype", "bf16",
        "--muon-exclude-patterns", "*.linear_proj.weight", "*.linear_fc2.weight", "--muon-momentum", "0.9",
        "--muon-no-split-qkv", "--muon-tp-mode", "distributed",
    ], world_size=1)
    cfg = optim.optimizer_config(args)
    assert type(cfg).__name__ == "MuonConfig"
    assert cfg.muon_nesterov is False and cfg.muon_split_qkv is False and cfg.muon_momentum == 0.9
    assert cfg.muon_ns_dtype == torch.float32 and cfg.muon_comm_dtype == torch.bfloat16
    assert cfg.muon_exclude_patterns == ("*.linear_proj.weight", "*.linear_fc2.weight")
    assert cfg.muon_tp_mode == "exact"  # Megatron-LM's 'distributed' is exact
    assert (cfg.lr, cfg.weight_decay, cfg.adam_beta2) == (0.01, 0.1, 0.95)  # from the recipe
    adam = optim.optimizer_config(arguments.parse_args(["--recipe", "tiny_gqa", "--optimizer", "adam"], world_size=1))
    assert type(adam).__name__ == "OptimizerConfig" and adam.optimizer == "adam"


def test_recipe_then_command_line(tmp_path):
    from megatron_muon.megatron_lm import arguments

    args = arguments.parse_args(["--recipe", "tiny_gqa", "--num-layers", "3", "--lr", "0.02"], world_size=2)
    assert (args.num_layers, args.lr, args.hidden_size, args.swiglu) == (3, 0.02, 64, True)
    assert args.add_bias_linear is False and args.num_query_groups == 2
    assert args.data_parallel_size == 2 and args.num_microbatches == 1
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "num_layers: 2\nhidden_size: 32\nnum-attention-heads: 2\nseq_length: 16\nmicro_batch_size: 2\n"
        "train_iters: 5\nlr: 1.0e-3\nmuon_nesterov: false\nadd_bias_linear: false\ndata-path: [a, b]\n"
    )
    args = arguments.parse_args(["--recipe", str(recipe)], world_size=1)
    assert args.muon_nesterov is False and args.add_bias_linear is False and args.data_path == ["a", "b"]
    assert args.ffn_hidden_size == 128 and args.kv_channels == 16 and args.global_batch_size == 2
    args = arguments.parse_args(["--recipe", str(recipe), "--muon-nesterov"], world_size=1)
    assert args.muon_nesterov is True
    args = arguments.parse_args(["--recipe", "tiny_moe_mla", "--no-qk-clip", "--no-swiglu"], world_size=1)
    assert args.qk_clip is False and args.swiglu is False and args.multi_latent_attention is True


def test_recipe_errors(tmp_path, capsys):
    from megatron_muon.megatron_lm import arguments

    with pytest.raises(SystemExit):
        arguments.parse_args(["--recipe", "no_such_recipe"], world_size=1)
    err = capsys.readouterr().err
    assert "unknown recipe 'no_such_recipe'" in err and "tiny_gqa" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("num-layers: 2\nnot-a-flag: 3\n")
    with pytest.raises(SystemExit):
        arguments.parse_args(["--recipe", str(bad)], world_size=1)
    assert "'not-a-flag' is not a known flag" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_size_recipe_shapes(name):
    """Parsed, accepted by Megatron's TransformerConfig checks, and the size published."""
    from megatron_muon.megatron_lm import arguments, model, sizing

    world, total, active = REAL[name]
    args = arguments.parse_args(["--recipe", name], world_size=world)
    config = model.transformer_config(args)
    assert config.num_layers == args.num_layers and config.hidden_size == args.hidden_size
    count = sizing.count_parameters(args, args.vocab_size)
    assert abs(count.total / total - 1) < 0.01, f"{name}: {count} vs published total {total / 1e9} B"
    if active is not None:
        assert abs(count.active / active - 1) < 0.03, f"{name}: {count} vs published active {active / 1e9} B"
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    assert text.startswith("#") and "[chosen]" in text  # sources and own choices are marked


def _build_tiny_recipes(names: List[str]) -> Dict[str, object]:
    """In a spawned rank: build each tiny recipe's model and optimizer, take two steps."""
    import torch._dynamo

    from megatron_muon.megatron_lm import arguments, model, optim, sizing, training
    from megatron_muon.megatron_lm.tokenizer import ByteTokenizer, padded_vocab_size

    torch._dynamo.config.disable = True
    out: Dict[str, object] = {}
    for name in names:
        args = arguments.parse_args(["--recipe", name, "--mock-data"], world_size=1)
        vocab = padded_vocab_size(ByteTokenizer().vocab_size, args.make_vocab_size_divisible_by, 1)
        try:
            chunks = model.build_model(args, model.transformer_config(args), vocab)
        except RuntimeError as exc:
            out[name] = f"error: {exc}"
            continue
        optimizer = optim.build_optimizer(args, chunks)
        training.setup_model_config(args, chunks, optimizer)
        gen = torch.Generator().manual_seed(0)

        def batches():
            while True:
                tokens = torch.randint(0, 256, (args.micro_batch_size, args.seq_length + 1), generator=gen)
                yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                       "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
                       "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1)}

        it = batches()
        steps = [training.train_step(args, chunks, optimizer, [it]) for _ in range(2)]
        out[name] = dict(params=model.count_parameters(chunks), expected=sizing.count_parameters(args, vocab).total,
                         steps=[(s[0]["lm loss"], s[1]) for s in steps], max_logit=steps[-1][3])
    return out


def test_tiny_recipes_build_and_step():
    from megatron_muon.testing import run_distributed

    result = run_distributed(_build_tiny_recipes, 1, TINY, timeout_s=200)[0]
    for name in TINY:
        got = result[name]
        if name == "tiny_moe_mla" and importlib.util.find_spec("megatron_muon.attention") is None:
            # MLA needs megatron_muon.attention; without it the failure must say so.
            assert isinstance(got, str) and "megatron_muon.attention" in got, got
            continue
        assert isinstance(got, dict), f"{name}: {got}"
        assert got["params"] == got["expected"], f"{name}: built {got['params']} params, sizing says {got['expected']}"
        assert all(ok for _, ok in got["steps"]) and all(torch.isfinite(torch.tensor(l)) for l, _ in got["steps"])
        if name == "tiny_moe_mla":  # QK-Clip and max-logit logging on: the attention recorded logits
            assert got["max_logit"] is not None and got["max_logit"] > 0
