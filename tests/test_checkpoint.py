"""Checkpoints: exact round trips and resume, atomic saves, corruption detection, pruning, clear errors."""

from __future__ import annotations

import errno
import io
import json
import random
import re

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open

from scratchlm.config import RunConfig
from scratchlm.data.batches import BatchSampler
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.optim.adamw import AdamW, param_groups_for
from scratchlm.train import checkpoint as ckpt
from scratchlm.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    load_checkpoint,
    load_for_inference,
    save_checkpoint,
)
from scratchlm.train.checkpoint_state import capture_rng_state, restore_rng_state
from scratchlm.train.loss import cross_entropy

TOKENS = np.random.default_rng(0).integers(0, 256, size=5_000).astype(np.uint16)


def make_setup(seed: int = 0, **model_overrides):
    torch.manual_seed(seed)
    config = ModelConfig.preset("tiny", **model_overrides)
    model = TransformerLM(config)
    optimizer = AdamW(param_groups_for(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    sampler = BatchSampler(TOKENS, 4, config.context_length, "cpu", seed=seed)
    return model, optimizer, sampler


def train_steps(model, optimizer, sampler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = sampler.next()
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # random draws a real loop makes (dropout-like noise, shuffles) must continue identically too
        losses.append(loss.item() + torch.rand(()).item() + np.random.rand() + random.random())
    return losses


def run_config_dict(**model_overrides) -> dict:
    return RunConfig(model=ModelConfig.preset("tiny", **model_overrides)).to_dict()


def save(manager, step, model, optimizer, sampler, val_loss=None):
    return manager.save(step, model, optimizer, config=run_config_dict(), sampler_state=sampler.state_dict(),
                        extra={"tokens_seen": step * 128}, val_loss=val_loss)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("to_buffer", [False, True])
def test_cs336_round_trip_path_and_file_object(tmp_path, to_buffer):
    model, optimizer, sampler = make_setup()
    train_steps(model, optimizer, sampler, 1)
    target = io.BytesIO() if to_buffer else tmp_path / "model.pt"
    save_checkpoint(model, optimizer, 1, target)
    if to_buffer:
        target.seek(0)
    other_model, other_optimizer, _ = make_setup(seed=1)
    assert load_checkpoint(target, other_model, other_optimizer) == 1
    assert_same_params(model, other_model)
    assert other_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_resume_continues_bitwise_identically(tmp_path):
    model, optimizer, sampler = make_setup()
    train_steps(model, optimizer, sampler, 2)
    manager = CheckpointManager(tmp_path / "run")
    path = save(manager, 2, model, optimizer, sampler)
    expected = train_steps(model, optimizer, sampler, 3)

    resumed_model, resumed_optimizer, resumed_sampler = make_setup(seed=5)
    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # clobber every RNG before resuming
    loaded = manager.load(manager.latest_valid(), resumed_model, resumed_optimizer)
    resumed_sampler.load_state_dict(loaded["sampler_state"])
    assert loaded["step"] == 2 and loaded["extra"] == {"tokens_seen": 256} and manager.latest_valid() == path
    assert RunConfig.from_dict(manager.config_of(path)).model == ModelConfig.preset("tiny")
    assert isinstance(resumed_optimizer.param_groups[0]["betas"], tuple)
    assert train_steps(resumed_model, resumed_optimizer, resumed_sampler, 3) == expected
    assert_same_params(model, resumed_model)


def test_tied_weights_are_stored_once_and_restored(tmp_path):
    model, optimizer, sampler = make_setup(tie_embeddings=True)
    train_steps(model, optimizer, sampler, 2)
    path = CheckpointManager(tmp_path).save(2, model, optimizer, config=run_config_dict(tie_embeddings=True),
                                            sampler_state=sampler.state_dict())
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    assert len(stored) == len(model.state_dict()) - 1
    loaded, config = load_for_inference(path)
    assert config.model.tie_embeddings and not loaded.training
    assert loaded.token_embeddings.weight is loaded.lm_head.weight
    assert_same_params(model, loaded)


def test_load_for_inference_from_run_dir_picks_newest_valid(tmp_path):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, optimizer, sampler)
    train_steps(model, optimizer, sampler, 1)
    save(manager, 2, model, optimizer, sampler)
    loaded, _ = load_for_inference(tmp_path)
    assert_same_params(model, loaded)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        load_for_inference(tmp_path / "checkpoints")
    with pytest.raises(FileNotFoundError, match="no run or checkpoint directory"):
        load_for_inference(tmp_path / "missing")


@pytest.mark.parametrize("writer, failure", [
    ("_write_json", OSError(errno.ENOSPC, "No space left on device")),  # after the weights were written
    # safetensors' Rust writer raises its own SafetensorError, not an OSError, when the disk is full
    ("save_file", SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")),
])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, writer, failure):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path)
    first = save(manager, 1, model, optimizer, sampler)

    def disk_full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(ckpt, writer, disk_full)
    with pytest.raises(CheckpointError, match=r"step_0000002: No space left on device; the previous checkpoint "
                                              r".*step_0000001 is intact") as raised:
        save(manager, 2, model, optimizer, sampler)
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".save.lock", "step_0000001"]  # no temp
    assert manager.latest_valid() == first and ckpt.verify(first) is None


def test_half_written_checkpoint_is_skipped_and_stale_temp_cleaned(tmp_path):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path)
    first = save(manager, 1, model, optimizer, sampler)
    half = tmp_path / "checkpoints" / "step_0000002"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    stale = tmp_path / "checkpoints" / ".tmp-step_0000003-999"
    stale.mkdir()
    stale_best = tmp_path / "checkpoints" / ".tmp-best.json"  # a crash while best.json was being replaced
    stale_best.write_text('{"step": 1, "val')
    with pytest.warns(CheckpointWarning, match=r"skipping checkpoint .*step_0000002: meta.json is missing"):
        assert manager.latest_valid() == first
    save(manager, 3, model, optimizer, sampler)
    assert stale.exists() and stale_best.exists()  # a save never removes temporaries: they may be a live writer's
    manager.remove_stale_temporaries()  # what the trainer does once it holds the run's lock
    assert not stale.exists() and not stale_best.exists()


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), r"model.safetensors has \d+ bytes, expected \d+ \(truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x00"), "model.safetensors fails its sha256 checksum"),
    (lambda p: p.unlink(), "model.safetensors is missing"),
])
def test_corrupt_checkpoint_is_detected_and_skipped(tmp_path, damage, message):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path)
    first = save(manager, 1, model, optimizer, sampler)
    second = save(manager, 2, model, optimizer, sampler)
    damage(second / "model.safetensors")
    with pytest.warns(CheckpointWarning, match=f"step_0000002: {message}"):
        assert manager.latest_valid() == first
    with pytest.raises(ValueError, match=f"step_0000002 cannot be loaded: {message}"):
        manager.load(second, model, optimizer)


def test_keeps_last_k_plus_best(tmp_path):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step, val_loss in zip(range(1, 6), [3.0, 1.0, 2.0, None, 5.0]):
        save(manager, step, model, optimizer, sampler, val_loss=val_loss)
    assert [p.name for p in manager.checkpoints()] == ["step_0000002", "step_0000004", "step_0000005"]
    assert manager.best().name == "step_0000002"
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text())["val_loss"] == 1.0


@pytest.mark.parametrize("content, problem", [
    ('{"step": 2, "val_loss": 1.0, "na', "is unreadable"),  # cut short
    ('{"step": 2, "val_loss": 1.0}', "is not a {'step', 'val_loss', 'name'} record"),
    ('{"step": 2, "val_loss": "low", "name": "step_0000002"}', "is not a {'step', 'val_loss', 'name'} record"),
])
def test_malformed_best_json_is_rebuilt_from_the_checkpoints(tmp_path, content, problem):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step, val_loss in [(1, 2.0), (2, 1.0)]:
        save(manager, step, model, optimizer, sampler, val_loss=val_loss)
    record = tmp_path / "checkpoints" / "best.json"
    record.write_text(content)
    with pytest.warns(CheckpointWarning, match=re.escape(f"{record} {problem}")):
        save(manager, 3, model, optimizer, sampler, val_loss=1.5)
    assert json.loads(record.read_text()) == {"step": 2, "val_loss": 1.0, "name": "step_0000002"}
    assert [p.name for p in manager.checkpoints()] == ["step_0000002", "step_0000003"]  # the best was not pruned


def test_saving_the_same_step_again_replaces_it(tmp_path):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, optimizer, sampler)
    train_steps(model, optimizer, sampler, 1)
    path = save(manager, 1, model, optimizer, sampler)
    other, _ = load_for_inference(path)
    assert_same_params(model, other)


def test_shape_mismatch_names_parameter_and_shapes(tmp_path):
    model, optimizer, sampler = make_setup()
    path = save(CheckpointManager(tmp_path), 1, model, optimizer, sampler)
    wider, wider_optimizer, _ = make_setup(d_model=32, num_heads=2)
    with pytest.raises(ValueError, match=r"parameter 'token_embeddings.weight' has shape \(256, 64\) in the "
                                         r"checkpoint but \(256, 32\) in the model"):
        CheckpointManager(tmp_path).load(path, wider, wider_optimizer)
    deeper, deeper_optimizer, _ = make_setup(num_layers=3)
    with pytest.raises(ValueError, match=r"missing tensors \['layers.2"):
        CheckpointManager(tmp_path).load(path, deeper, deeper_optimizer)


def test_unwritable_run_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the run directory should be")
    model, optimizer, sampler = make_setup()
    with pytest.raises(CheckpointError, match="run directory .*not_a_dir/run is not writable"):
        save(CheckpointManager(blocker / "run"), 1, model, optimizer, sampler)


def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def test_malformed_meta_is_reported_not_raised(tmp_path):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path)
    first = save(manager, 1, model, optimizer, sampler)
    second = save(manager, 2, model, optimizer, sampler)
    meta = json.loads((second / "meta.json").read_text())
    meta["files"] = {"model.safetensors": {"sha256": "0"}}  # parses, but has no byte count
    (second / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(CheckpointWarning, match="step_0000002: meta.json is malformed"):
        assert manager.latest_valid() == first


def test_a_corrupt_later_checkpoint_does_not_push_out_valid_ones(tmp_path):
    model, optimizer, sampler = make_setup()
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        save(manager, step, model, optimizer, sampler)
    (tmp_path / "checkpoints" / "step_0000030" / "model.safetensors").write_bytes(b"garbage")
    with pytest.warns(CheckpointWarning):
        assert manager.latest_valid().name == "step_0000020"
    save(manager, 23, model, optimizer, sampler)  # the resumed run is stopped (SIGTERM) before step 30
    names = [p.name for p in manager.checkpoints()]
    assert names == ["step_0000020", "step_0000023", "step_0000030"]  # two valid ones kept, not one
