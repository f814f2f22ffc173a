"""Experiment tracking in MetricsLogger, with fake ``wandb`` and ``torch.utils.tensorboard`` modules (no network,
no tensorboard package needed): which scalars go out at which step, the W&B run id kept in RUN/wandb_id so a
resume continues the same W&B run, TensorBoard's purge of events past a resumed checkpoint, and the one-line
error naming the [tracking] extra when the package is missing."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from scratchlm.extras import MissingExtra
from scratchlm.train.metrics import TENSORBOARD_DIR, WANDB_ID_FILE, MetricsLogger, tracked_scalars

TRAIN = {"kind": "train", "step": 10, "tokens": 1280, "wall_time": 1.5, "train_time": 1.2, "loss": 2.5, "lr": 1e-3,
         "grad_norm": 0.7, "tokens_per_s": 900.0, "mfu": None}
EVAL = {"kind": "eval", "step": 10, "tokens": 1280, "wall_time": 1.6, "train_time": 1.2, "val_loss": 2.6,
        "val_ppl": 13.5}
END = {"kind": "end", "step": 10, "status": "finished", "message": ""}


class FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.ids = iter(["first-id", "second-id"])
        self.util = types.SimpleNamespace(generate_id=lambda: next(self.ids))

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((values, step)), finish=lambda: None)


class FakeSummaryWriter:
    made: list[FakeSummaryWriter] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        FakeSummaryWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.append((tag, value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_wandb(monkeypatch) -> FakeWandb:
    module = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


@pytest.fixture
def fake_tensorboard(monkeypatch) -> type[FakeSummaryWriter]:
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    FakeSummaryWriter.made = []
    return FakeSummaryWriter


def log_all(logger: MetricsLogger) -> None:
    for record in (TRAIN, EVAL, END):
        logger.log(dict(record))
    logger.close()


def test_tracked_scalars_are_the_numbers_of_a_record():
    assert tracked_scalars(TRAIN) == {"train/tokens": 1280, "train/wall_time": 1.5, "train/train_time": 1.2,
                                      "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.7,
                                      "train/tokens_per_s": 900.0}  # mfu None (CPU) is left out
    assert tracked_scalars(EVAL)["eval/val_loss"] == 2.6 and "eval/step" not in tracked_scalars(EVAL)


def test_tensorboard_gets_loss_lr_grad_norm_val_loss_and_throughput(tmp_path: Path, fake_tensorboard):
    log_all(MetricsLogger(tmp_path, total_steps=10, quiet=True, tensorboard=True))
    (writer,) = fake_tensorboard.made
    assert writer.log_dir == str(tmp_path / TENSORBOARD_DIR) and writer.purge_step is None and writer.closed
    tags = {tag: (value, step) for tag, value, step in writer.scalars}
    for tag, value in (("train/loss", 2.5), ("train/lr", 1e-3), ("train/grad_norm", 0.7),
                       ("train/tokens_per_s", 900.0), ("eval/val_loss", 2.6)):
        assert tags[tag] == (value, 10)
    assert not any(tag.startswith("end/") for tag in tags)


def test_a_resumed_run_purges_tensorboard_events_past_its_checkpoint(tmp_path: Path, fake_tensorboard):
    MetricsLogger(tmp_path, total_steps=10, start_step=6, quiet=True, tensorboard=True).close()
    assert fake_tensorboard.made[-1].purge_step == 7  # step 6's events were written before the checkpoint


def test_wandb_resume_continues_the_run_named_in_the_run_directory(tmp_path: Path, fake_wandb):
    log_all(MetricsLogger(tmp_path, total_steps=10, quiet=True, wandb_project="proj", wandb_config={"a": 1}))
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == "first-id"
    MetricsLogger(tmp_path, total_steps=10, start_step=10, quiet=True, wandb_project="proj").close()
    first, resumed = fake_wandb.inits
    assert first["id"] == resumed["id"] == "first-id"  # not "second-id": the same W&B run
    assert first["resume"] == resumed["resume"] == "allow" and first["project"] == "proj"
    assert first["dir"] == str(tmp_path) and first["config"] == {"a": 1}
    assert [step for _, step in fake_wandb.logged] == [10, 10]  # train and eval; the end record is not a metric
    assert fake_wandb.logged[0][0]["train/loss"] == 2.5


def test_a_new_run_directory_gets_a_new_wandb_run(tmp_path: Path, fake_wandb):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        MetricsLogger(tmp_path / name, total_steps=1, quiet=True, wandb_project="p").close()
    assert [init["id"] for init in fake_wandb.inits] == ["first-id", "second-id"]


@pytest.mark.parametrize("kwargs, package, setting", [
    ({"tensorboard": True}, "tensorboard", "train.tensorboard = true"),
    ({"wandb_project": "p"}, "wandb", "train.wandb = true"),
])
def test_tracking_without_its_package_names_the_tracking_extra(tmp_path, monkeypatch, kwargs, package, setting):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(MissingExtra, match=rf"^{setting} needs the {package} package, .*'scratchlm\[tracking\]'$"):
        MetricsLogger(tmp_path, total_steps=1, quiet=True, **kwargs)
