"""DDP and FSDP2 on the CPU with gloo and 2 processes, checked against a single process on the same global batch.

- Step level (exact composition of the global batch): 2 ranks x micro-batches of b rows equal one process whose
  micro-batch j is the concatenation of the ranks' micro-batch j. Losses (averaged over ranks), grad norms and
  the final full parameters and AdamW moments must match the single-process run to fp32 round-off, for DDP
  from step 0 and for FSDP2 resumed from a single-process state (world 1 -> 2) and gathered back (2 -> 1).
- Samplers: a rank's stream replayed from rank 0's saved state equals the stream it really drew.
- Trainer level (``torchrun -m scratchlm.train``): only rank 0 writes, and a run saved at world size 2 resumes
  at 1 and one saved at 1 resumes at 2, every rank continuing its own data stream.

Processes are started with torch.multiprocessing (spawn) or torchrun; all use tiny models and a few steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from scratchlm.cli import main as cli_main
from scratchlm.config import RunConfig, TrainConfig
from scratchlm.data.batches import BatchSampler
from scratchlm.data.token_file import write_token_file
from scratchlm.model import TransformerLM
from scratchlm.train import distributed
from scratchlm.train.setup import build_optimizer
from scratchlm.train.step import train_step

WORLD_SIZE = 2
MICRO_BATCHES = 2  # gradient accumulation: exercises no_sync on all but the last micro-batch
ROWS_PER_RANK = 2
STEPS = 3
LR = 3e-3
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HOOKED = "parallel" in {f.name for f in dataclasses.fields(TrainConfig)}
needs_trainer_hooks = pytest.mark.skipif(
    not HOOKED, reason="needs the trainer hooks (train.parallel; distributed.launch in `scratchlm train`, "
                       "restore_sampler/checkpoint_sources/optimizer_for in trainer.py)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_run_config() -> RunConfig:
    return RunConfig.from_dict({"model": {"preset": "tiny", "context_length": 16}, "optim": {"warmup_iters": 0},
                                "train": {"max_steps": STEPS, "device": "cpu"}})


def global_batches(config: RunConfig) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """STEPS x MICRO_BATCHES micro-batches of WORLD_SIZE * ROWS_PER_RANK rows, from a fixed generator."""
    generator = torch.Generator().manual_seed(1234)
    rows, length, vocab = WORLD_SIZE * ROWS_PER_RANK, config.model.context_length, config.model.vocab_size
    windows = [[torch.randint(0, vocab, (rows, length + 1), generator=generator) for _ in range(MICRO_BATCHES)]
               for _ in range(STEPS)]
    return [[(w[:, :-1], w[:, 1:]) for w in step] for step in windows]


def rank_slice(batches, rank: int):
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return [[(x[rows], y[rows]) for x, y in step] for step in batches]


def fresh_model(config: RunConfig) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(config.model)


def run_steps(model, optimizer, batches) -> list[tuple[float, float]]:
    """(loss averaged over ranks, grad norm) per step, through the trainer's own train_step."""
    record = []
    for step_batches in batches:
        loss, norm = train_step(model, optimizer, step_batches, lr=LR, grad_clip=1.0)
        record.append((distributed.mean_across_ranks(loss).item(), distributed.as_full_tensor(norm).item()))
    return record


def single_process_reference(config: RunConfig, out: Path) -> dict:
    """The single-process trajectory on the global batches; saves its full state after step 1 for FSDP."""
    model = fresh_model(config)
    optimizer = build_optimizer(model, config)
    batches = global_batches(config)
    history = run_steps(model, optimizer, batches[:1])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out / "after_step1.pt")
    history += run_steps(model, optimizer, batches[1:])
    return {"history": history, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _worker(rank: int, port: int, out: Path, data: Path) -> None:
    """Step-level DDP/FSDP2 parity, then (with the trainer hooks) a 2-rank `scratchlm train` run in which each
    rank is given its own run directory: rank 1's must stay absent."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    distributed.setup("cpu")
    clean = False
    try:
        _step_level(rank, out)
        if HOOKED:  # `scratchlm train` finds the process group up, uses it and tears it down
            exit_code = cli_main(["train", *train_args(data, out / f"run_rank{rank}", steps=4), "--quiet"])
            (out / f"exit_rank{rank}").write_text(str(exit_code))
        clean = True
    finally:
        distributed.teardown(clean=clean)


def train_args(data: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    sets = [f"data.train_path={data / 'train.tok'}", f"data.val_path={data / 'valid.tok'}", "data.batch_size=4",
            f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=2", "train.checkpoint_every=2",
            "model.context_length=16", "optim.warmup_iters=1", *extra]
    return ["--config", str(CONFIGS / "tiny.toml"), "--run-dir", str(run_dir), *[f"--set={s}" for s in sets]]


def _step_level(rank: int, out: Path) -> None:
    config = tiny_run_config()
    mine = rank_slice(global_batches(config), rank)
    # DDP from step 0.
    ddp = distributed.wrap_ddp(fresh_model(config), config)
    optimizer = build_optimizer(ddp.module, config)
    ddp_history = run_steps(ddp, optimizer, mine)
    ddp_state = distributed.full_state_dicts(ddp, optimizer)
    # FSDP2 resumed from the single-process state after step 1 (world size 1 -> 2), then gathered (2 -> 1).
    model = distributed.wrap_fsdp(fresh_model(config), config)
    optimizer = build_optimizer(model, config)
    saved = torch.load(out / "after_step1.pt", weights_only=True)
    distributed.load_full_state(model, optimizer, saved["model"], saved["optimizer"])
    fsdp_history = run_steps(model, optimizer, mine[1:])
    fsdp_state = distributed.full_state_dicts(model, optimizer)
    if rank == 0:
        torch.save({"ddp": (ddp_history, *ddp_state), "fsdp": (fsdp_history, *fsdp_state)}, out / "ranks.pt")
    else:
        torch.save({"fsdp_state_sizes": (len(fsdp_state[0]), len(fsdp_state[1]))}, out / "rank1.pt")


def assert_states_close(got: tuple[dict, dict], want: dict) -> None:
    model_state, optimizer_state = got
    # Why atol 1e-5 (losses and grad norms agree to 1e-6): AdamW divides by sqrt(v), so a gradient entry near 0
    # whose fp32 round-off differs (two half-batch sums vs one sum) moves by up to ~lr/1000 in one step.
    torch.testing.assert_close(model_state, want["model"], rtol=1e-5, atol=1e-5)
    assert optimizer_state["param_groups"] == want["optimizer"]["param_groups"]
    torch.testing.assert_close(optimizer_state["state"], want["optimizer"]["state"], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Byte-level token files (vocab 256) of repeated short sentences."""
    folder = tmp_path_factory.mktemp("data")
    text = b"the cat sat on the mat. a dog ran to the park. we like red apples! "
    for name, repeats in (("train.tok", 60), ("valid.tok", 6)):
        write_token_file(folder / name, np.frombuffer(text * repeats, dtype=np.uint8), vocab_size=256)
    return folder


@pytest.fixture(scope="module")
def spawned(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("spawned")
    torch.save(single_process_reference(tiny_run_config(), out), out / "reference.pt")
    mp.spawn(_worker, args=(free_port(), out, data), nprocs=WORLD_SIZE, join=True)
    return out


@pytest.fixture(scope="module")
def step_level(spawned) -> dict:
    return {"reference": torch.load(spawned / "reference.pt", weights_only=True),
            **torch.load(spawned / "ranks.pt", weights_only=True),
            **torch.load(spawned / "rank1.pt", weights_only=True)}


def test_ddp_matches_single_process_on_the_global_batch(step_level):
    history, *state = step_level["ddp"]
    reference = step_level["reference"]
    torch.testing.assert_close(torch.tensor(history), torch.tensor(reference["history"]), rtol=1e-6, atol=1e-6)
    assert_states_close(tuple(state), reference)


def test_fsdp2_resumed_from_world_1_matches_and_gathers_full_state(step_level):
    history, *state = step_level["fsdp"]
    reference = step_level["reference"]
    torch.testing.assert_close(torch.tensor(history), torch.tensor(reference["history"][1:]), rtol=1e-6,
                               atol=1e-6)
    assert_states_close(tuple(state), reference)
    # The gathered state loads into a plain single-process model and optimizer (world size 2 -> 1).
    config = tiny_run_config()
    model = fresh_model(config)
    optimizer = build_optimizer(model, config)
    distributed.load_full_state(model, optimizer, *state)
    assert_states_close((model.state_dict(), optimizer.state_dict()), reference)


def test_fsdp2_full_state_lives_on_rank_0_only(step_level):
    assert step_level["fsdp_state_sizes"] == (0, 0)


@pytest.mark.parametrize("saved_rank,new_rank,new_world", [(0, 1, 2), (0, 0, 1), (0, 2, 3), (0, 1, 4)])
def test_restored_sampler_continues_its_own_stream(saved_rank, new_rank, new_world):
    tokens = torch.arange(5000).numpy() % 256
    saved = BatchSampler(tokens, 3, 8, "cpu", seed=7, rank=saved_rank, world_size=2)
    truth = BatchSampler(tokens, 3, 8, "cpu", seed=7, rank=new_rank, world_size=new_world)
    for _ in range(5):
        saved.next()
        truth.next()
    restored = BatchSampler(tokens, 3, 8, "cpu", seed=99, rank=new_rank, world_size=new_world)
    distributed.restore_sampler(restored, saved.state_dict())
    for _ in range(3):
        for got, want in zip(restored.next(), truth.next()):
            assert torch.equal(got, want)
    assert restored.batches_drawn == truth.batches_drawn == 8


def test_restore_sampler_refuses_a_different_batch_shape():
    tokens = torch.arange(5000).numpy() % 256
    saved = BatchSampler(tokens, 3, 8, "cpu", seed=7).state_dict()
    other = BatchSampler(tokens, 4, 8, "cpu", seed=7, rank=1, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        distributed.restore_sampler(other, saved)


def test_setup_names_missing_torchrun_variables(monkeypatch):
    for name in distributed.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        distributed.setup("cpu")
    assert not distributed.launched_by_torchrun()


def test_setup_refuses_a_fixed_cuda_index(monkeypatch):
    for name, value in zip(distributed.TORCHRUN_VARIABLES, ("0", "1", "0", "127.0.0.1", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        distributed.setup("cuda:1")


def test_unknown_parallel_mode_is_refused():
    with pytest.raises(ValueError, match="train.parallel must be one of .*ddp"):
        RunConfig.from_dict({"train": {"parallel": "zero3"}})


# ---- trainer level: `scratchlm train` under 2 ranks ---------------------------------------------------------

def metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


@needs_trainer_hooks
def test_only_rank_0_writes(spawned):
    assert (spawned / "exit_rank0").read_text() == (spawned / "exit_rank1").read_text() == "0"
    assert not (spawned / "run_rank1").exists()
    run = spawned / "run_rank0"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [".save.lock", "best.json", "step_0000002",
                                                                        "step_0000004"]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]  # one writer: every step logged once
    assert metrics(run)[-1]["tokens"] == 4 * 4 * 16 * WORLD_SIZE  # steps x batch x context x ranks


@needs_trainer_hooks
def test_resume_world_2_at_world_1(spawned, data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(spawned / "run_rank0", run)
    assert cli_main(["train", *train_args(data, run, steps=6), "--resume", "--quiet"]) == 0
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    # 4 steps on 2 ranks, then 2 on one: the token count carries over instead of being recomputed from steps.
    assert metrics(run)[-1]["tokens"] == 4 * 16 * (4 * WORLD_SIZE + 2)
    assert [r["step"] for r in metrics(run, "eval")] == [2, 4, 6]


@needs_trainer_hooks
def test_resume_world_1_at_world_2_with_torchrun(data, tmp_path):
    run = tmp_path / "run"
    assert cli_main(["train", *train_args(data, run, steps=2), "--quiet"]) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
               "-m", "scratchlm.train", *train_args(data, run, 4, "train.device=auto"), "--resume"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in metrics(run))
    assert "finished 4 steps" in done.stderr and done.stderr.count("finished 4 steps") == 1  # rank 0 only
    assert (run / "checkpoints" / "step_0000004").is_dir()
    # The setting as given, not rank 0's device: a rank's cuda:N would be refused when resuming under torchrun.
    assert 'device = "auto"' in (run / "config.toml").read_text()


@needs_trainer_hooks
def test_a_budgeted_run_with_auto_dtype_under_torchrun_follows_rank_0s_choices(data, tmp_path):
    """Rank 0 chooses the dtype, plans the budget and re-plans it; every rank must follow (distributed.rank_zeros),
    or the ranks would stop at different steps and the run would hang in a collective."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
               "-m", "scratchlm.train", *train_args(data, run, 100_000, "train.dtype=auto"), "--budget", "6s"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("train.dtype = auto") == 1 and done.stderr.count("budget 6 s:") == 1  # rank 0 only
    steps = [r["step"] for r in metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] < 100_000  # one writer; the budget, not max_steps, ended it
    assert done.stderr.count(f"finished {steps[-1]} steps") == 1
