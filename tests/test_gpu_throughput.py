"""The GPU throughput benchmark's CPU-side parts: its shapes build valid configs (the modern recipe at the
tinystories-17m shape included) and its table rows format, so a lent GPU's few minutes are never lost to a typo."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_throughput  # noqa: E402
from scratchlm.model import TransformerLM  # noqa: E402


def test_every_shape_builds_a_valid_config_and_model():
    for shape in gpu_throughput.SHAPES:
        config = gpu_throughput.run_config(shape)
        assert config.train.dtype == "bf16" and config.train.compile and config.model.context_length >= 256
        TransformerLM(config.model, device="meta")
    modern = gpu_throughput.run_config(gpu_throughput.Shape("tinystories-17m", 128, "modern"))
    assert modern.optim.optimizer == "muon" and modern.model.qk_norm and modern.model.ffn == "swiglu"
    assert not modern.model.logit_softcap
    assert (modern.model.d_model, modern.model.num_layers, modern.model.vocab_size) == (512, 4, 10_000)


def test_rows_and_verdicts_format():
    row = {"preset": "tinystories-17m", "recipe": "cs336", "batch_size": 128, "context_length": 256,
           "parameters": 22.7e6, "step_ms": 10.0, "tokens_per_s": 450_000, "tflops": 100.0, "mfu": 0.1,
           "peak_memory_gib": 3.0}
    assert gpu_throughput.verdict(row).startswith("PASS")
    assert gpu_throughput.verdict({**row, "recipe": "modern"}) == "n/a"
    assert gpu_throughput.markdown_row(row).count("|") == 11
    failed = {"preset": "gpt2-small", "recipe": "cs336", "batch_size": 32, "error": "OOM"}
    assert "ERROR: OOM" in gpu_throughput.markdown_row(failed)
