"""Run GGUF files through llama.cpp (llama-cpp-python) for our tests and benchmarks: JSON in on stdin, JSON out.

This file runs under the venv scripts/setup_llama_cpp.sh builds, which has llama_cpp and numpy but neither torch
nor scratchlm, so it imports nothing of ours (benchmarks/llama_cpp_client.py starts it). The request is a list of
models, each ``{"model": PATH, "n_ctx": N, "n_threads": T, "logits_all": bool, "f32_cache": bool, "jobs": [...]}``
(``f32_cache``: keys and values cached in float32, as ours are, rather than llama.cpp's default f16, for comparing
logits); the reply holds one result per job, in order:

    {"op": "tokenize", "texts": [str]}                      -> [[id]]: special tokens parsed, no BOS added
    {"op": "greedy", "prompt": [id], "max_tokens": n}       -> [id]: argmax of each next token's logits
    {"op": "logits", "tokens": [id]}                        -> [[float]]: every position's logits (small models)
    {"op": "nll", "windows": [[id]]}                        -> [float]: per window, the summed -ln p(token | before)
                                                               of its tokens after the first, in nats
    {"op": "time_decode", "prompt": [id], "tokens": n, "repeats": r} -> [seconds]: n greedy tokens after the prompt
    {"op": "time_prompt", "tokens": [id], "repeats": r}     -> [seconds]: one forward over the tokens (one batch)

Each sequence starts from an empty context (``reset``); logits are llama.cpp's, sampled by numpy's argmax here,
so no sampler of llama-cpp-python's (penalties, temperature) takes part.
"""

from __future__ import annotations

import json
import sys
import time


def _logits(llm, position: int):
    return llm.scores[position]


def _greedy(llm, prompt: list[int], max_tokens: int) -> list[int]:
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(max_tokens):
        token = int(np.argmax(_logits(llm, llm.n_tokens - 1)))
        out.append(token)
        llm.eval([token])
    return out


def _nll(llm, window: list[int]) -> float:
    import numpy as np

    llm.reset()
    llm.eval(window)
    logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)  # (T-1, V): predicting tokens 1..T-1
    top = logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return float((log_z - logits[np.arange(len(window) - 1), window[1:]]).sum())


def _time_decode(llm, prompt: list[int], tokens: int, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        _greedy(llm, prompt, tokens)
        seconds.append(time.perf_counter() - start)
    return seconds


def _time_prompt(llm, tokens: list[int], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        seconds.append(time.perf_counter() - start)
    return seconds


def run_job(llm, job: dict):
    op = job["op"]
    if op == "tokenize":
        return [llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in job["texts"]]
    if op == "greedy":
        return _greedy(llm, job["prompt"], job["max_tokens"])
    if op == "logits":
        llm.reset()
        llm.eval(job["tokens"])
        return [list(map(float, llm.scores[i])) for i in range(len(job["tokens"]))]
    if op == "nll":
        return [_nll(llm, window) for window in job["windows"]]
    if op == "time_decode":
        return _time_decode(llm, job["prompt"], job["tokens"], job["repeats"])
    if op == "time_prompt":
        return _time_prompt(llm, job["tokens"], job["repeats"])
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    import llama_cpp

    request = json.load(sys.stdin)
    replies = []
    for spec in request:
        n_ctx = spec.get("n_ctx", 512)
        cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if spec.get("f32_cache") else {}
        llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                              n_threads=spec.get("n_threads", 1), n_threads_batch=spec.get("n_threads", 1),
                              logits_all=spec.get("logits_all", True), verbose=False, **cache)
        replies.append([run_job(llm, job) for job in spec["jobs"]])
        llm.close()
    json.dump({"llama_cpp": llama_cpp.__version__, "results": replies}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
