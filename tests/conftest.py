"""Shared test fixtures: the real data in ../shared/data (skipped with a reason when absent) and seeding."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from scratchlm.paths import DATA_DIR_ENV, describe_search, shared_data_file
from scratchlm.tokenizer import Tokenizer

# One intra-op thread per test process: the suite runs under pytest-xdist on 2 cores, and oversubscribed
# OpenMP threads slow every test several-fold.
torch.set_num_threads(1)


def require_shared(relative: str) -> Path:
    """Path of a shared data file, or skip the test naming what is missing and where it was looked for."""
    path = shared_data_file(relative)
    if path is None:
        pytest.skip(f"shared data file {relative!r} not found (looked in: {describe_search()}; "
                    f"set {DATA_DIR_ENV} to point at the shared data folder)")
    return path


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to count inside the block and put back after it, so a test that needs a thread
    count of its own leaves its neighbours the count they expect."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def gpt2_file_paths() -> tuple[Path, Path]:
    """(vocab.json, merges.txt) of the real GPT-2 tokenizer, or skip as require_shared does."""
    return require_shared("fixtures/gpt2_vocab.json"), require_shared("fixtures/gpt2_merges.txt")


def gpt2_tokenizer(*, fast: bool = True) -> Tokenizer:
    """The real GPT-2 tokenizer with <|endoftext|>; fast=False encodes through the readable encoder (the oracle)."""
    return Tokenizer.from_files(*gpt2_file_paths(), ["<|endoftext|>"], fast=fast)


@pytest.fixture
def gpt2_files() -> tuple[Path, Path]:
    """(vocab.json, merges.txt) of the real GPT-2 tokenizer."""
    return gpt2_file_paths()


@pytest.fixture
def tinystories_sample() -> Path:
    return require_shared("fixtures/tinystories_sample.txt")


@pytest.fixture
def hf_offline_one_thread(monkeypatch):
    """No Hub access (every Hugging Face model and tokenizer here is built locally) and one intra-op thread, for
    comparisons with transformers that must not depend on how a matmul is split across threads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """One intra-op thread for a whole module: tiny matmuls on a busy 2-core machine run ~50x faster than two threads
    spin-waiting, and bitwise-comparable losses across runs need equal thread counts (tests/test_trainer.py)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def hf_offline_module():
    """No Hub access for a whole module (its module-scoped fixtures build Hugging Face tokenizers)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (none available)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
