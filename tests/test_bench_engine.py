"""benchmarks/bench_engine.py: its split of the engine's time adds up, and its ceiling bounds what it measured."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_engine  # noqa: E402
import bench_serve  # noqa: E402


@pytest.mark.parametrize("prompt", ["a", bench_serve.PROMPT])  # a one-token prompt's forward is a prefill's
def test_the_split_adds_up_and_steps_only_bounds_the_load(tmp_path, monkeypatch, prompt):
    monkeypatch.setattr(bench_serve, "PROMPT", prompt)
    run = bench_serve.write_random_run("tiny", tmp_path)
    results = bench_engine.measure_engine(run, [1, 2], requests=2, max_tokens=8)
    assert [r["clients"] for r in results] == [1, 2]
    for r in results:
        parts = [r["steps_s"], r["prefills_s"], r["other_s"], r["idle_s"]]
        assert all(part >= 0 for part in parts), parts
        assert sum(parts) == pytest.approx(r["seconds"])
        assert r["prefills_s"] > 0 and r["steps_s"] > 0
        assert 0 < r["tokens_per_request"] <= 8
        assert r["steps_only_tokens_per_s"] > r["tokens_per_s"]
