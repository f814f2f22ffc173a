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

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from scratchlm.config import RunConfig
from scratchlm.data.batches import BatchSampler
from scratchlm.model import TransformerLM
from scratchlm.train import distributed
from scratchlm.train.trainer import build_optimizer, train_step

WORLD_SIZE = 2
MICRO_BATCHES = 2  # gradient accumulation: exercises no_sync on all but the last micro-batch
ROWS_PER_RANK = 2
STEPS = 3
LR = 3e-3


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


def _step_level_worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    distributed.setup("cpu")
    clean = False
    try:
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
        clean = True
    finally:
        distributed.teardown(clean=clean)


def assert_states_close(got: tuple[dict, dict], want: dict) -> None:
    model_state, optimizer_state = got
    # Why atol 1e-5 (losses and grad norms agree to 1e-6): AdamW divides by sqrt(v), so a gradient entry near 0
    # whose fp32 round-off differs (two half-batch sums vs one sum) moves by up to ~lr/1000 in one step.
    torch.testing.assert_close(model_state, want["model"], rtol=1e-5, atol=1e-5)
    assert optimizer_state["param_groups"] == want["optimizer"]["param_groups"]
    torch.testing.assert_close(optimizer_state["state"], want["optimizer"]["state"], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def step_level(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("step_level")
    reference = single_process_reference(tiny_run_config(), out)
    mp.spawn(_step_level_worker, args=(free_port(), out), nprocs=WORLD_SIZE, join=True)
    return {"reference": reference, **torch.load(out / "ranks.pt", weights_only=True),
            **torch.load(out / "rank1.pt", weights_only=True)}


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
    with pytest.raises(ValueError, match="ddp"):
        distributed.wrap_fn("zero3")
