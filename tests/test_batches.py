"""get_batch, BatchSampler and validation_batches: real windows, uniform starts, memmaps never fully read."""

from __future__ import annotations

import json
import re

import numpy as np
import psutil
import pytest
import torch

from scratchlm.data.batches import BatchSampler, get_batch, validation_batches


def check_windows(data: np.ndarray, x: torch.Tensor, y: torch.Tensor, context_length: int) -> list[int]:
    """Assert every row is a real slice of ``data`` (targets shifted by one); return the start positions."""
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape and x.shape[1] == context_length
    starts = x[:, 0].numpy().astype(np.int64)  # data is arange, so a value is its own position
    offsets = np.arange(context_length)
    np.testing.assert_array_equal(x.numpy(), data[starts[:, None] + offsets])
    np.testing.assert_array_equal(y.numpy(), data[starts[:, None] + offsets + 1])
    return starts.tolist()


def test_windows_are_slices_and_all_starts_are_drawn_uniformly():
    n, context_length = 20, 4
    data = np.arange(n, dtype=np.uint16)
    x, y = get_batch(data, 17_000, context_length, "cpu", generator=np.random.default_rng(0))
    counts = np.bincount(check_windows(data, x, y, context_length), minlength=n)
    possible = n - context_length  # starts 0 .. n - T - 1
    assert (counts[:possible] > 0).all() and (counts[possible:] == 0).all()
    expected = len(x) / possible
    chi_square = ((counts[:possible] - expected) ** 2 / expected).sum()
    assert chi_square < 50, f"start counts far from uniform: {counts[:possible]}"  # df=15: p ~ 1e-5


def test_global_numpy_seed_makes_get_batch_reproducible():
    data = np.arange(1000, dtype=np.int64)
    np.random.seed(3)
    first = get_batch(data, 4, 8, "cpu")
    np.random.seed(3)
    second = get_batch(data, 4, 8, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_exact_length_dataset_has_one_window():
    data = np.arange(9, dtype=np.uint32)
    x, y = get_batch(data, 3, 8, "cpu")
    assert check_windows(data, x, y, 8) == [0, 0, 0]


def test_huge_memmap_is_not_read_whole(tmp_path):
    num_tokens = 2**31  # 4 GiB of uint16: a sparse file, so it costs no disk
    path = tmp_path / "huge.bin"
    with open(path, "wb") as file:
        file.truncate(2 * num_tokens)
        file.seek(2 * (num_tokens - 9))
        file.write(np.arange(1, 10, dtype=np.uint16).tobytes())
    tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(num_tokens,))
    rss_before = psutil.Process().memory_info().rss
    for seed in range(20):
        x, y = get_batch(tokens, 8, 64, "cpu", generator=np.random.default_rng(seed))
        assert x.shape == (8, 64)
    assert psutil.Process().memory_info().rss - rss_before < 200 * 2**20
    _, tail_targets = next(validation_batches(tokens[-17:], 2, 8, "cpu"))  # the file's last 17 tokens
    assert torch.equal(tail_targets[1], torch.arange(2, 10))


@pytest.mark.parametrize("length", [0, 5, 8])
def test_too_short_dataset_names_the_lengths(length):
    with pytest.raises(ValueError, match=f"dataset has {length} tokens, fewer than context_length \\+ 1 = 9"):
        get_batch(np.zeros(length, dtype=np.uint16), 2, 8, "cpu")


def test_bad_arrays_are_rejected():
    with pytest.raises(ValueError, match="1-D token array"):
        get_batch(np.zeros((4, 10), dtype=np.uint16), 2, 3, "cpu")
    with pytest.raises(ValueError, match="integer token ids"):
        get_batch(np.zeros(10, dtype=np.float32), 2, 3, "cpu")
    with pytest.raises(ValueError, match="batch_size and context_length must be >= 1"):
        get_batch(np.zeros(10, dtype=np.uint16), 0, 3, "cpu")


def test_sampler_resume_gives_identical_batches():
    data = np.arange(5000, dtype=np.uint16)
    sampler = BatchSampler(data, 4, 16, "cpu", seed=11)
    for _ in range(3):
        sampler.next()
    state = json.loads(json.dumps(sampler.state_dict()))  # must survive JSON
    expected = [sampler.next() for _ in range(5)]
    resumed = BatchSampler(data, 4, 16, "cpu", seed=11)
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == 3
    for (ex, ey), (rx, ry) in zip(expected, (resumed.next() for _ in range(5))):
        assert torch.equal(ex, rx) and torch.equal(ey, ry)


def test_sampler_streams_differ_by_rank_and_seed_but_repeat_per_seed():
    data = np.arange(100_000, dtype=np.uint32)

    def first_batch(seed, rank):
        return BatchSampler(data, 8, 16, "cpu", seed=seed, rank=rank, world_size=2).next()[0]

    assert torch.equal(first_batch(0, 0), first_batch(0, 0))
    assert not torch.equal(first_batch(0, 0), first_batch(0, 1))
    assert not torch.equal(first_batch(0, 0), first_batch(1, 0))


def test_sampler_rejects_incompatible_state_and_bad_rank():
    data = np.arange(1000, dtype=np.uint16)
    state = BatchSampler(data, 4, 16, "cpu", seed=1).state_dict()
    with pytest.raises(ValueError, match="saved batch_size=4 but this run has batch_size=8"):
        BatchSampler(data, 8, 16, "cpu", seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        BatchSampler(data, 4, 16, "cpu", seed=1, rank=2, world_size=2)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda state: state.pop("bit_generator"), "malformed: it has no ['bit_generator']"),
    (lambda state: state.update(bit_generator="PCG64"), "malformed: its bit_generator 'PCG64' is not a PCG64 state"),
    (lambda state: state["bit_generator"].pop("state"), "malformed: its bit_generator {'bit_generator': 'PCG64'"),
], ids=["no bit_generator", "bit_generator not a dict", "bit_generator without its state"])
def test_sampler_rejects_a_malformed_state_naming_what_is_wrong(damage, message):
    data = np.arange(1000, dtype=np.uint16)
    state = json.loads(json.dumps(BatchSampler(data, 4, 16, "cpu", seed=1).state_dict()))  # as a checkpoint holds it
    damage(state)
    with pytest.raises(ValueError, match=re.escape(f"BatchSampler: the checkpoint's sampler state is {message}")):
        BatchSampler(data, 4, 16, "cpu", seed=1).load_state_dict(state)


def test_validation_batches_cover_the_file_in_order():
    data = np.arange(103, dtype=np.uint16)  # (103 - 1) // 10 = 10 windows -> batches of 4, 4, 2
    batches = list(validation_batches(data, 4, 10, "cpu"))
    assert [len(x) for x, _ in batches] == [4, 4, 2]
    inputs = torch.cat([x for x, _ in batches]).flatten()
    targets = torch.cat([y for _, y in batches]).flatten()
    assert torch.equal(inputs, torch.arange(100))
    assert torch.equal(targets, torch.arange(1, 101))
    again = list(validation_batches(data, 4, 10, "cpu"))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))


def test_validation_batches_max_batches_and_errors():
    data = np.arange(1000, dtype=np.uint16)
    assert len(list(validation_batches(data, 4, 10, "cpu", max_batches=3))) == 3
    with pytest.raises(ValueError, match="max_batches must be >= 1"):
        validation_batches(data, 4, 10, "cpu", max_batches=0)
    with pytest.raises(ValueError, match="dataset has 10 tokens"):
        validation_batches(data[:10], 4, 10, "cpu")


@pytest.mark.cuda
def test_cuda_batches_are_on_device():
    x, y = get_batch(np.arange(1000, dtype=np.uint16), 4, 16, "cuda", generator=np.random.default_rng(0))
    assert x.is_cuda and y.is_cuda
    check_windows(np.arange(1000), x.cpu(), y.cpu(), 16)
