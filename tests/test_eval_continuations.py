"""`scratchlm eval --continuations`: log p(continuation | context) the way lm-evaluation-harness requests it.

The oracle scores each request alone, without padding or batching: one forward pass of the model over the last
context_length + 1 tokens of context + continuation (less the last), F.log_softmax, and the continuation's
entries picked by hand. The tokenization rules (whitespace moved, the pair encoded whole, the end-of-text token
for an empty context) are checked on cases where each rule changes the ids. scripts/check_lm_eval.sh compares the
numbers with lm_eval itself on an export.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scratchlm.cli import main as cli_main
from scratchlm.model import TransformerLM
from scratchlm.model.config import ModelConfig
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.train.loglikelihood import Request, encode_request, read_requests, score_requests, score_tokens
from tiny_runs import text_tokenizer, train_tiny_run

TEXT = "the cat sat on the mat. there the dog ran to the park! we like red apples.<|endoftext|>" * 40
CONTEXT_LENGTH = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return text_tokenizer(tmp_path_factory.mktemp("tok"), TEXT)


@pytest.fixture(scope="module")
def model(tokenizer) -> TransformerLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=CONTEXT_LENGTH, d_model=32, num_layers=2,
                         num_heads=2, d_ff=64)
    return TransformerLM(config).eval()


def oracle(model: TransformerLM, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """One request, unbatched: sum of F.log_softmax at the continuation's tokens; greedy if each is the argmax."""
    sequence = (context_ids + continuation_ids)[-(CONTEXT_LENGTH + 1):]
    with torch.no_grad():
        log_probs = F.log_softmax(model(torch.tensor([sequence[:-1]]))[0].double(), dim=-1)  # (T, V)
    total, greedy = 0.0, True
    for offset, token in enumerate(continuation_ids):
        position = len(sequence) - 1 - len(continuation_ids) + offset  # the position that predicts `token`
        total += log_probs[position, token].item()
        greedy &= int(log_probs[position].argmax()) == token
    return total, greedy


def random_text(rng: random.Random, words: int) -> str:
    vocabulary = ["the", "cat", "sat", "on", "mat.", "dog", "ran", "park!", "red", "apples", "zebra", "é", "  "]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def test_scores_equal_an_unbatched_log_softmax_oracle(model, tokenizer):
    """Random contexts (some longer than the model's context, so truncated from the left), continuations with and
    without a leading space, batched three at a time (so right-padded rows) against one pass each."""
    rng = random.Random(0)
    requests = [Request(line, random_text(rng, rng.randint(1, 14)) + rng.choice(["", " ", "  "]),
                        rng.choice(["", " "]) + random_text(rng, rng.randint(1, 3))) for line in range(1, 25)]
    scores = score_requests(model, tokenizer, requests, CONTEXT_LENGTH, source="requests", batch_size=3)
    assert any(len(tokenizer.encode(r.context + r.continuation)) > CONTEXT_LENGTH + 1 for r in requests)
    for request, score in zip(requests, scores):
        context_ids, continuation_ids = encode_request(tokenizer, request.context, request.continuation)
        expected, greedy = oracle(model, context_ids, continuation_ids)
        assert score.loglikelihood == pytest.approx(expected, abs=1e-5), request
        assert score.is_greedy == greedy and score.tokens == len(continuation_ids)


def test_greedy_flag_is_true_exactly_for_the_argmax_continuation(model):
    context = [5, 9, 17, 3]
    sequence = list(context)
    with torch.no_grad():
        for _ in range(4):  # greedy decoding, one token at a time
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    greedy = sequence[len(context):]
    other = [*greedy[:2], (greedy[2] + 1) % model.config.vocab_size, greedy[3]]
    scored = score_tokens(model, [(context, greedy), (context, other), (context, greedy[:1])], CONTEXT_LENGTH,
                          batch_size=2)
    assert [score.is_greedy for score in scored] == [True, False, True]
    assert scored[1].loglikelihood < scored[0].loglikelihood
    assert scored[0].loglikelihood == pytest.approx(oracle(model, context, greedy)[0], abs=1e-5)


def test_encode_request_follows_lm_eval(tokenizer):
    eot = tokenizer.special_id("<|endoftext|>")
    # Trailing whitespace of the context belongs to the continuation: " mat" is one token, "mat" another.
    context_ids, continuation_ids = encode_request(tokenizer, "the cat sat on the ", "mat")
    assert context_ids == tokenizer.encode("the cat sat on the")
    assert continuation_ids == tokenizer.encode(" mat") != tokenizer.encode("mat")
    # The pair is encoded whole and cut at the context's length: a token that spans the boundary is the
    # continuation's ("the" + "re" encodes as " there", not " the" + "re").
    whole = tokenizer.encode(" there")
    assert len(whole) == 1 and tokenizer.encode(" the") + tokenizer.encode("re") != whole
    assert encode_request(tokenizer, "cat sat", " there") == (tokenizer.encode("cat sat"), whole)
    assert encode_request(tokenizer, "cat sat the", "re dog")[1] == \
        tokenizer.encode("cat sat there dog")[len(tokenizer.encode("cat sat the")):]
    # No context: the continuation follows the end-of-text token.
    assert encode_request(tokenizer, "", "the cat") == ([eot], tokenizer.encode("the cat"))
    # ... unless the continuation starts with it (lm_eval 0.4.13): then that one is the context.
    assert encode_request(tokenizer, "", "<|endoftext|>the cat") == ([eot], tokenizer.encode("the cat"))
    assert encode_request(tokenizer, "", "<|endoftext|>") == ([eot], [])


def test_an_empty_context_needs_the_end_of_text_token(tokenizer):
    plain = Tokenizer(tokenizer.vocab, tokenizer.merges, [])
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        encode_request(plain, "", "the cat")


def test_unscorable_continuations_name_their_line(model, tokenizer):
    long = Request(7, "the", " cat" * (CONTEXT_LENGTH + 1))
    with pytest.raises(ValueError, match=r"^in.jsonl:7: the continuation is 17 tokens; the model scores 1 to its"):
        score_requests(model, tokenizer, [long], CONTEXT_LENGTH, source="in.jsonl")
    empty = Request(3, "the cat", "")
    with pytest.raises(ValueError, match=r"^in.jsonl:3: the continuation is 0 tokens"):
        score_requests(model, tokenizer, [empty], CONTEXT_LENGTH, source="in.jsonl")


@pytest.mark.parametrize(("line", "message"), [
    ('{"context": "a", "continuation": ', "malformed JSON"),
    ('["a", "b"]', "want a JSON object"),
    ('{"continuation": "b"}', "field 'context' is missing"),
    ('{"context": "a", "continuation": 3}', "field 'continuation' is 3, not a string"),
])
def test_bad_lines_are_one_error_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "in.jsonl"
    path.write_text('{"context": "a", "continuation": " b"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{path}:3: {message}"):
        read_requests(path)


def test_a_file_without_requests_is_refused(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="no requests"):
        read_requests(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("continuations"), tokenizer, TEXT, steps=2, batch_size=2)


def test_cli_prints_and_writes_the_library_scores(run, tmp_path, capsys):
    from scratchlm.train.checkpoint import load_for_inference

    requests = [{"context": "the cat sat on the ", "continuation": "mat"}, {"context": "", "continuation": "we"},
                {"context": "a dog ran to the", "continuation": " park!"}]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(request) + "\n" for request in requests), encoding="utf-8")
    out = tmp_path / "scores.jsonl"
    assert cli_main(["eval", "--checkpoint", str(run), "--continuations", str(source), "--out", str(out),
                     "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.splitlines()
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]

    model, config = load_for_inference(run)
    tokenizer = Tokenizer.load(run / "tokenizer")
    expected = score_requests(model, tokenizer, read_requests(source), config.model.context_length, source=source)
    assert [record["line"] for record in written] == [1, 2, 3]
    for record, score in zip(written, expected):
        assert record["loglikelihood"] == pytest.approx(score.loglikelihood, abs=1e-6)
        assert (record["is_greedy"], record["tokens"]) == (score.is_greedy, score.tokens)
    assert printed[0].startswith(f"line 1: log-likelihood {written[0]['loglikelihood']:.6f} over")
    assert printed[-1] == f"3 continuations, {sum(s.is_greedy for s in expected)} greedy  ({source})"


def test_cli_window_scores_what_a_shorter_model_window_reads(run, tmp_path, capsys):
    """--window W: the model reads the last W tokens of context + continuation (lm_eval's local-completions)."""
    from scratchlm.train.checkpoint import load_for_inference

    model, config = load_for_inference(run)
    tokenizer = Tokenizer.load(run / "tokenizer")
    context = config.model.context_length
    long = " ".join(["the cat sat on the mat"] * context)  # longer than the context: windows differ
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"context": long, "continuation": " the dog"}) + "\n", encoding="utf-8")
    context_ids, continuation_ids = encode_request(tokenizer, long, " the dog")
    tokens = (context_ids + continuation_ids)[-(context - 1):]  # what the model reads with --window context - 2
    with torch.no_grad():
        scores = model(torch.tensor([tokens[:-1]]))[0].log_softmax(-1)[-len(continuation_ids):]
    oracle = scores.gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()
    results = {}
    for window in (context - 2, context):
        out = tmp_path / f"scores-{window}.jsonl"
        assert cli_main(["eval", "--checkpoint", str(run), "--continuations", str(source), "--out", str(out),
                         "--window", str(window), "--device", "cpu"]) == 0
        results[window] = json.loads(out.read_text(encoding="utf-8"))["loglikelihood"]
    assert results[context - 2] == pytest.approx(oracle, abs=1e-5)
    assert abs(results[context] - results[context - 2]) > 1e-4  # the default reads two tokens more
    for window in ("0", str(context + 1)):
        assert cli_main(["eval", "--checkpoint", str(run), "--continuations", str(source), "--window", window]) != 0
        assert f"--window must be in [1, {context}] (the model's context_length), got {window}" in \
            capsys.readouterr().err


def test_cli_refuses_out_without_continuations_and_both_inputs(run, tmp_path, capsys):
    source = tmp_path / "requests.jsonl"
    source.write_text('{"context": "a", "continuation": " b"}\n', encoding="utf-8")
    assert cli_main(["eval", "--checkpoint", str(run), "--data", "x.tok", "--out", str(tmp_path / "o")]) != 0
    assert "--out writes the scores of --continuations" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --data and --continuations are exclusive
        cli_main(["eval", "--checkpoint", str(run), "--data", "x.tok", "--continuations", str(source)])
    with pytest.raises(SystemExit):  # and one of them is required
        cli_main(["eval", "--checkpoint", str(run)])
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a"}\n', encoding="utf-8")
    assert cli_main(["eval", "--checkpoint", str(run), "--continuations", str(bad)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad}:1: field 'continuation' is missing" in err
