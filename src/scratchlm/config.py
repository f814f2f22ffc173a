"""RunConfig: everything a training run needs, as four dataclasses (model, optim, data, train).

Configs flow one way: TOML file(s) -> plain dict -> dotted ``--set`` overrides -> dataclasses, validated once in
``__post_init__``. A TOML file may start from another (``extends = "base.toml"``) and a ``[model]`` table may
name a preset (``preset = "tinystories-17m"``), so presets and ablations are small diffs. Unknown keys and wrong
types are errors that list the valid keys / the expected type. Data paths written in a TOML file are relative
to that file's folder; paths given with ``--set`` and ``train.run_dir`` are relative to the working directory.
The resolved config is written back with ``save_toml`` (a tiny writer: the format is four flat tables) into the
run directory, as the run stores every config (``run_relative``): its paths relative to the run directory and no
``train.run_dir``, which is the folder the file is in. A run can then be moved or copied as a whole.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scratchlm.model.config import PRESETS, ModelConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

DTYPES = ("fp32", "bf16", "fp16")
DATA_FORMATS = ("tokens", "conversations")
PACKINGS = ("packed", "padded")
TRAIN_DTYPES = (*DTYPES, "auto")  # auto: bf16 where the device has bf16 arithmetic, else fp32 (train/precision.py)
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # DTYPES -> torch attribute names
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt")
MUON_ADJUST_LR = ("original", "match_rms_adamw")
MUON_NS_DTYPES = ("auto", "bfloat16", "float32")
MUON_PARAMS = r"^layers\.\d+\.(attn\.(q|k|v|output)_proj|ffn\.w[123])\.weight$"  # the hidden matrices
PARALLEL = ("ddp", "fsdp")
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


@dataclass
class OptimConfig:
    optimizer: str = "adamw"  # adamw | muon (Muon for the hidden 2-D matrices, AdamW for embeddings, head, gains)
    lr: float = 1e-3  # peak learning rate of the AdamW parameters, reached at the end of warm-up
    min_lr: float = 1e-4  # where the decay ends; every group's rate is scaled by the same lr(t) / lr
    warmup_iters: int = 100
    schedule: str = "cosine"  # cosine | wsd (warm-up, stable, then decay over the last decay_fraction of the run)
    cosine_cycle_iters: int | None = None  # None: decay over the whole run (train.max_steps)
    decay_fraction: float = 0.2  # wsd: the share of the run spent decaying from lr to min_lr
    decay_shape: str = "linear"  # wsd: linear | 1-sqrt (the cool-down's shape)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only (norm gains and embeddings-as-vectors skip it)
    grad_clip: float = 1.0  # max global L2 norm of the gradients; 0 disables clipping
    embedding_lr: float | None = None  # peak rate of the token embeddings (None: lr)
    head_lr: float | None = None  # peak rate of an untied lm_head (None: lr)
    muon_lr: float = 0.02  # muon: peak rate of the hidden matrices
    muon_momentum: float = 0.95
    muon_adjust_lr: str = "original"  # muon: original | match_rms_adamw (torch.optim.Muon's adjust_lr_fn)
    muon_params: str = MUON_PARAMS  # muon: regular expression over parameter names (matched ones go to Muon)
    muon_ns_dtype: str = "auto"  # muon: Newton-Schulz in bfloat16 | float32 | auto (as train.dtype = auto)

    def __post_init__(self) -> None:
        _require_choices("optim", self, optimizer=OPTIMIZERS, schedule=SCHEDULES, decay_shape=DECAY_SHAPES,
                         muon_adjust_lr=MUON_ADJUST_LR, muon_ns_dtype=MUON_NS_DTYPES)
        for name in ("lr", "eps", "muon_lr"):
            _require(getattr(self, name) > 0, f"optim.{name} must be positive, got {getattr(self, name)}")
        _require(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        _require(self.warmup_iters >= 0, f"optim.warmup_iters must be >= 0, got {self.warmup_iters}")
        _require(0 < self.decay_fraction <= 1, f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        _require(all(0 <= b < 1 for b in self.betas), f"optim.betas must each be in [0, 1), got {self.betas}")
        _require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        for name in ("embedding_lr", "head_lr"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"optim.{name} must be positive (or none: optim.lr), got {value}")
        _require(0 <= self.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        try:
            re.compile(self.muon_params)
        except re.error as error:
            raise ValueError(f"optim.muon_params {self.muon_params!r} is not a regular expression: {error}") from None


@dataclass
class DataConfig:
    train_path: str = ""  # token file written by `scratchlm data encode` (format = conversations: JSON lines)
    val_path: str = ""  # "" disables evaluation (format = conversations: unless val_fraction holds some out)
    tokenizer: str | None = None  # tokenizer directory: its hash is checked against the token files
    tokenizer_hash: str | None = None  # recorded by train (Tokenizer.hash); generate/eval/export/--resume check it
    batch_size: int = 32  # sequences per optimizer step (split into train.grad_accum_steps micro-batches)
    format: str = "tokens"  # tokens (token files) | conversations (fine-tuning's JSON lines: finetune/)
    packing: str = "packed"  # conversations: packed (several a sequence, kept apart) | padded (one a sequence)
    train_on_prompt: bool = False  # conversations: the loss counts every token, not only the assistant's
    val_fraction: float = 0.0  # conversations without val_path: hold out this fraction of the records

    def __post_init__(self) -> None:
        _require(self.batch_size > 0, f"data.batch_size must be positive, got {self.batch_size}")
        _require_choices("data", self, format=DATA_FORMATS, packing=PACKINGS)
        _require(0.0 <= self.val_fraction < 1.0, f"data.val_fraction must be in [0, 1), got {self.val_fraction}")


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps; the schedule decays over them (set by the plan under a budget)
    budget_seconds: float | None = None  # a time budget: max_steps is planned from a measured step (train/budget.py)
    budget_includes_eval: bool = True  # the budget covers evaluations too (false: training time alone)
    threads: int | None = None  # torch intra-op threads (None: torch's default); a budget's probe sets it
    grad_accum_steps: int = 1  # micro-batches per step: data.batch_size must be divisible by it
    device: str = "auto"  # auto (cuda -> mps -> cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (autocast; master weights fp32; fp16: CUDA, loss scaling) | auto
    compile: bool = False  # torch.compile the model
    fused_attention: bool | None = None  # torch's fused SDPA kernel (None: on CUDA; elsewhere our chunked kernel)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~30% more compute
    tf32: bool = True  # CUDA only: fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation)
    parallel: str = "ddp"  # under torchrun: ddp (replicate the model) | fsdp (FSDP2: shard it); unused alone
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 20  # validation batches per evaluation (the same ones every time)
    checkpoint_every: int = 500
    keep_last: int = 3
    seed: int = 0  # seeds the initialization and the batch sampler
    run_dir: str = "runs/run"
    init_from: str | None = None  # start from these weights (a run, a checkpoint, a Hugging Face folder): init_from.py
    max_loss: float | None = None  # a train loss above this counts as divergence (non-finite always does)
    wandb: bool = False  # log to Weights & Biases (the [tracking] extra); RUN/wandb_id makes a resume continue it
    wandb_project: str = "scratchlm"
    tensorboard: bool = False  # write TensorBoard scalars to RUN/tensorboard/ (the [tracking] extra)

    def __post_init__(self) -> None:
        for name in ("max_steps", "grad_accum_steps", "log_every", "eval_every", "eval_batches",
                     "checkpoint_every", "keep_last"):
            _require(getattr(self, name) > 0, f"train.{name} must be positive, got {getattr(self, name)}")
        # numpy's generators take only non-negative seeds: caught here, not at the first batch, naming the key.
        _require(self.seed >= 0, f"train.seed must be >= 0, got {self.seed}")
        _require_choices("train", self, dtype=TRAIN_DTYPES, parallel=PARALLEL)
        _require(bool(DEVICE_PATTERN.fullmatch(self.device)),  # fullmatch: $ alone would let "cpu\n" through
                 f"train.device must be auto, cpu, mps, cuda or cuda:N, got {self.device!r}")
        _require(bool(self.run_dir), "train.run_dir must not be empty")
        _require(self.threads is None or self.threads > 0, f"train.threads must be positive, got {self.threads}")
        _require(self.budget_seconds is None or (math.isfinite(self.budget_seconds) and self.budget_seconds > 0),
                 f"train.budget_seconds must be a positive number of seconds (or none), got {self.budget_seconds}")


SECTIONS: dict[str, type] = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "train": TrainConfig}
PATH_KEYS = {"data": ("train_path", "val_path", "tokenizer"),  # resolved against the defining TOML's folder
             "train": ("init_from",)}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        steps = self.train.max_steps
        _require(self.optim.warmup_iters <= steps,
                 f"optim.warmup_iters ({self.optim.warmup_iters}) must not exceed train.max_steps ({steps})")
        cycle = self.optim.cosine_cycle_iters
        _require(cycle is None or cycle >= 1,
                 f"optim.cosine_cycle_iters must be >= 1 (or none: the whole run), got {cycle}")
        if self.optim.schedule == "wsd":
            decay = round(self.optim.decay_fraction * steps)
            _require(self.optim.warmup_iters <= steps - decay,
                     f"optim.warmup_iters ({self.optim.warmup_iters}) must end before the wsd decay starts (step "
                     f"{steps - decay} of train.max_steps = {steps} with optim.decay_fraction = "
                     f"{self.optim.decay_fraction})")
        _require(cycle is None or cycle >= self.optim.warmup_iters,
                 f"optim.cosine_cycle_iters ({cycle}) must not be below optim.warmup_iters ({self.optim.warmup_iters})")
        _require(self.data.batch_size % self.train.grad_accum_steps == 0,
                 f"data.batch_size ({self.data.batch_size}) must be divisible by train.grad_accum_steps "
                 f"({self.train.grad_accum_steps})")

    @property
    def micro_batch_size(self) -> int:
        return self.data.batch_size // self.train.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.data.batch_size * self.model.context_length

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from ``{"model": {...}, "optim": {...}, ...}``; missing sections/keys take defaults."""
        _check_keys(values, SECTIONS, "config")
        sections = {}
        for name, section_cls in SECTIONS.items():
            table = values.get(name, {})
            if not isinstance(table, dict):
                raise ValueError(f"config section [{name}] must be a table, got {table!r}")
            sections[name] = _build_section(name, section_cls, table)
        return cls(**sections)

    def with_overrides(self, overrides: list[str], source: str | Path | None = None) -> RunConfig:
        """A copy with dotted ``section.key=value`` overrides applied (strings parsed to each field's type): for a
        config read from ``source``, what ``load_config(source, overrides)`` gives, errors naming it too."""
        values = self.to_dict()
        apply_overrides(values, overrides)
        return _built(values, source)

    def with_values(self, **sections: dict[str, Any]) -> RunConfig:
        """A copy with fields replaced section by section, ``config.with_values(train={"dtype": "bf16"})``: how
        library code changes a config (each section, then the whole, validated again as when loaded)."""
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **fields)
                                            for name, fields in sections.items()})

    def save_toml(self, path: str | Path) -> None:
        """Write this config as a run's config.toml: ``run_relative`` to the file's folder, the run directory."""
        path = Path(path)
        text = RESOLVED_HEADER + RUN_RELATIVE_NOTE + to_toml(run_relative(self.to_dict(), path.parent))
        path.write_text(text, encoding="utf-8")


# First line of every config.toml that train writes: a file without it is the user's, never to be overwritten.
RESOLVED_HEADER = "# resolved config written by scratchlm (every setting; edits are kept only in your own file)\n"
RUN_RELATIVE_NOTE = "# paths are relative to this folder, the run directory (train.run_dir)\n"


def is_resolved_config(path: str | Path) -> bool:
    """Was ``path`` written by ``save_toml`` (so a run may rewrite it)?"""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.readline() == RESOLVED_HEADER


def run_relative(values: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """A config dict as a run stores it (RUN/config.toml, every checkpoint's config.json): each path relative to the
    run directory, and no train.run_dir (the run directory is wherever the file is found).

    Why: nothing in a run then names the place it was trained in, so a run that is copied or moved (to another
    machine, into another project) still evaluates, generates, exports and resumes. Its tokenizer is its own copy
    (``tokenizer``); a token file keeps its place relative to the run (``../../data/train.tok``) and is needed
    only to train on.
    """
    stored = copy.deepcopy(values)
    stored.get("train", {}).pop("run_dir", None)
    folder = Path(run_dir).resolve()
    for section, keys in PATH_KEYS.items():
        table = stored.get(section, {})
        for key in keys:
            if table.get(key):
                table[key] = os.path.relpath(Path(table[key]).resolve(), folder)
    return stored


def located_at(values: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """The inverse of ``run_relative`` for a run found at ``run_dir``: its paths resolved against it, and train.run_dir
    set to it. (A config a run saved before runs were relative keeps the absolute paths and run_dir it names.)"""
    located = copy.deepcopy(values)
    _resolve_paths(located, Path(run_dir))
    train = located.setdefault("train", {})
    if isinstance(train, dict):
        train.setdefault("run_dir", str(Path(run_dir).resolve()))
    return located


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML config (following ``extends``), apply ``--set`` overrides, build and validate it."""
    values = read_toml_tree(Path(path))
    apply_overrides(values, overrides or [])
    return _built(values, path)


def _built(values: dict[str, Any], path: str | Path | None) -> RunConfig:
    """The config of ``values``; an error names ``path``, the file they were read from (if any)."""
    try:
        return RunConfig.from_dict(values)
    except (TypeError, ValueError) as error:
        if path is None:
            raise
        raise ValueError(f"{path}: {error}") from None


def read_toml_tree(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The merged dict of a TOML file and the files it ``extends`` (the child's keys win)."""
    path = path.resolve()
    if path in _seen:
        raise ValueError(f"config {path} extends itself (cycle: {' -> '.join(str(p) for p in (*_seen, path))})")
    if path.is_dir():
        raise ValueError(f"config {path} is a folder, not a TOML file")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: invalid TOML: {error}") from None
    if text.startswith(RESOLVED_HEADER):  # a run's own config.toml: relative to the run, wherever it is now
        values = located_at(values, path.parent)
    else:
        _resolve_paths(values, path.parent)
    parent = values.pop("extends", None)
    if parent is None:
        return values
    if not isinstance(parent, str):
        raise ValueError(f"{path}: extends must be a file name string, got {parent!r}")
    base = read_toml_tree(path.parent / parent, (*_seen, path))
    for name, table in values.items():
        if isinstance(table, dict) and isinstance(base.get(name), dict):
            base[name] = {**base[name], **table}
        else:
            base[name] = table
    return base


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``section.key=value`` strings in place; the value string is parsed to the field's type."""
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-3")
        _check_keys({section: None}, SECTIONS, "config")
        types_ = _field_types(SECTIONS[section])
        if section == "model":
            types_["preset"] = str
        _check_keys({key: None}, types_, f"[{section}]")
        if section == "model" and key == "preset":
            # A preset is a new base model: model fields already set (in the file, or resolved by an earlier
            # override) would otherwise silently win over it. Later `--set model.*` overrides still apply.
            values["model"] = {}
        values.setdefault(section, {})[key] = parse_value(raw.strip(), types_[key], f"{section}.{key}")
    _resolve_paths(values, Path.cwd())  # a path typed on the command line is relative to where it was typed


def stated_values(overrides: list[str], section: str) -> dict[str, Any]:
    """The values ``overrides`` set in one section, parsed as ``apply_overrides`` parses them (the fields a user
    stated on the command line: train.init_from refuses a ``--set model.*`` that is not the source's)."""
    values: dict[str, Any] = {}
    apply_overrides(values, [item for item in overrides if item.partition("=")[0].strip().partition(".")[0] == section])
    return values.get(section, {})


def parse_value(raw: str, annotation: Any, name: str) -> Any:
    """Parse a command-line string to ``annotation`` (int, float incl. 3e-3, bool, str, tuples, optionals)."""
    options = _alternatives(annotation)
    if type(None) in options and raw.lower() in ("none", "null"):
        return None
    target = next(t for t in options if t is not type(None))
    try:
        if typing.get_origin(target) is tuple:
            parts = [p for p in re.split(r"[,\s]+", raw.strip("()[] ")) if p]
            return tuple(parse_value(p, t, name) for p, t in zip(parts, typing.get_args(target), strict=True))
        if target is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        return target(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {_type_name(annotation)}") from None


def to_toml(values: dict[str, dict[str, Any]]) -> str:
    """TOML text for flat tables of scalars and tuples (None values are omitted: they mean 'default')."""
    lines = []
    for section, table in values.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items() if value is not None)
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, float):
        return repr(value)  # round-trips the float exactly, in TOML's spelling (1e-05, 10000.0, inf, -inf, nan)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def _toml_string(text: str) -> str:
    # Backslash, quote and control characters are the only ones a TOML basic string cannot hold literally.
    escaped = "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c for c in text)
    return f'"{escaped}"'


def _build_section(name: str, section_cls: type, table: dict[str, Any]) -> Any:
    table = dict(table)
    if name == "model" and "preset" in table:
        preset = table.pop("preset")
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}")
        table = {**PRESETS[preset], **table}
    types_ = _field_types(section_cls)
    _check_keys(table, types_, f"[{name}]")
    return section_cls(**{key: _coerce(value, types_[key], f"{name}.{key}") for key, value in table.items()})


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Check a TOML value against a field type; ints widen to floats and lists become tuples."""
    for target in _alternatives(annotation):
        if target is type(None) and value is None:
            return None
        if typing.get_origin(target) is tuple and isinstance(value, list | tuple):
            args = typing.get_args(target)
            if len(value) == len(args):
                return tuple(_coerce(v, t, name) for v, t in zip(value, args))
        if target is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if target in (int, str, bool) and type(value) is target:
            return value
    raise ValueError(f"{name} must be {_type_name(annotation)}, got {value!r} ({type(value).__name__})")


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _check_keys(values: dict[str, Any], valid: dict[str, Any], where: str) -> None:
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid keys: {sorted(valid)}")


def _resolve_paths(values: dict[str, Any], folder: Path) -> None:
    for section, keys in PATH_KEYS.items():
        table = values.get(section)
        if not isinstance(table, dict):
            continue
        for key in keys:
            if isinstance(table.get(key), str) and table[key] and not Path(table[key]).is_absolute():
                table[key] = str((folder / table[key]).resolve())


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    """The types a field accepts: the members of a union (``int | None``), else the type itself."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


def _type_name(annotation: Any) -> str:
    if len(options := _alternatives(annotation)) > 1:
        return " or ".join(_type_name(a) for a in options)
    if typing.get_origin(annotation) is tuple:
        return "a list of " + ", ".join(_type_name(a) for a in typing.get_args(annotation))
    return "none" if annotation is type(None) else annotation.__name__


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_choices(section: str, table: Any, **choices: tuple[str, ...]) -> None:
    """Each named field of ``table`` (a section's dataclass) must be one of its choices."""
    for name, allowed in choices.items():
        value = getattr(table, name)
        _require(value in allowed, f"{section}.{name} must be one of {allowed}, got {value!r}")
