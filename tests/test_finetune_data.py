"""Fine-tuning data: records checked one line each, the loss mask equal to the assistant's turns on the real chat
templates (a conversational prompt-completion's: the completion's turns only), packing and the row sampler, ChatML
growth, and the HH-RLHF / TinyStories builders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import require_shared
from scratchlm.errors import UserError
from scratchlm.finetune.conversations import Completion, Conversation, read_examples
from scratchlm.finetune.data import grow_vocabulary
from scratchlm.finetune.packing import RowSampler, build_rows
from scratchlm.finetune.rendering import Rendered, render_example
from scratchlm.model.config import ModelConfig
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.loss import IGNORED

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello. How can I help?"},
                {"role": "user", "content": "A story, please."},
                {"role": "assistant", "content": "Tom had a red ball.\n\nThe end."}]


@pytest.fixture(scope="module")
def bpe() -> tuple[dict, list]:
    return train_bpe(require_shared("fixtures/tinystories_sample.txt"), 400, [], num_workers=1)


@pytest.fixture(scope="module")
def chatml(bpe) -> Tokenizer:
    return Tokenizer(*bpe, ["<|endoftext|>"]).with_chatml()


# ------------------------------------------------------------------------------------------------ records
@pytest.mark.parametrize(("line", "message"), [
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "hi"}', "fields: 'text'"),
    ('{"messages": []}', "messages: empty list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role: unknown role 'bot'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content: expected a string"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "messages[0].role: the conversation starts with"),
    ('{"prompt": "x"}', "completion: missing"),
    ('{"prompt": "x", "completion": ["y"]}', "completion: expected a string, got list"),
    ('{"prompt": "x", "completion": ""}', "completion: empty"),
    ('{"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}',
     "completion: expected a string, got list (or give prompt and completion both as lists of messages)"),
    ('{"prompt": [{"role": "user", "content": "x"}], "completion": "y"}',
     "completion: expected a list of messages, as the prompt is one, got str"),
    ('{"prompt": [], "completion": [{"role": "assistant", "content": "y"}]}', "prompt: empty list"),
    ('{"prompt": [{"role": "bot", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}]}',
     "prompt[0].role: unknown role 'bot'"),
    ('{"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": 5}]}',
     "completion[0].content: expected a string or a list of text parts, got int"),
    ('{"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}, '
     '{"role": "user", "content": "z"}]}', "completion[1].role: 'user', but a completion ends with the assistant's"),
    ('{"prompt": [{"role": "assistant", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}]}',
     "prompt[0].role: the conversation starts with the assistant"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]}',
     "messages[0].content[0].type: 'image_url' parts are not supported: this model reads text"),
])
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n' + line + "\n")
    with pytest.raises(UserError) as error:
        read_examples([str(path)])
    assert str(error.value).startswith(f"{path}:3: ") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_records_of_both_formats_from_a_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    (tmp_path / "d" / "b.jsonl").write_text('{"prompt": "2+2=", "completion": "4"}\n')
    first, second = read_examples([str(tmp_path / "d")])
    assert isinstance(first, Conversation) and first.messages[2]["content"] == "Hello. How can I help?"
    assert second == Completion("2+2=", "4", f"{tmp_path / 'd' / 'b.jsonl'}:1")


def test_conversational_prompt_completion_is_the_conversation_trained_from_the_completion(tmp_path):
    prompt, completion = CONVERSATION[:4], CONVERSATION[4:]
    parts = [{**message, "content": [{"type": "text", "text": message["content"]}]} for message in completion]
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "completion": completion}) + "\n"
                    + json.dumps({"prompt": prompt, "completion": parts}) + "\n")
    first, second = read_examples([str(path)])
    assert first == Conversation(tuple(CONVERSATION), f"{path}:1", trained_from=4)
    assert second.messages == first.messages  # text parts read as their text


# ------------------------------------------------------------------------------------------------ the mask
def assistant_texts(tokenizer: Tokenizer, rendered: Rendered) -> list[str]:
    """The decoded runs of counted tokens."""
    runs, current = [], []
    for token, counted in zip(rendered.ids.tolist(), rendered.counted.tolist()):
        if counted:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in runs + ([current] if current else [])]


def test_mask_is_the_assistant_turns_with_chatml(chatml):
    rendered = render_example(Conversation(tuple(CONVERSATION), "x:1"), chatml)
    assert rendered.ids.tolist() == chatml.encode_chat(CONVERSATION)
    assert assistant_texts(chatml, rendered) == ["Hello. How can I help?<|im_end|>",
                                                 "Tom had a red ball.\n\nThe end.<|im_end|>"]
    everything = render_example(Conversation(tuple(CONVERSATION), "x:1"), chatml, train_on_prompt=True)
    assert everything.counted.all()


# The turn as each real template writes it, before its end-of-turn token.
REAL = {"Qwen2.5-0.5B-Instruct": ("<|im_end|>", lambda content, last: content),
        "SmolLM2-135M-Instruct": ("<|im_end|>", lambda content, last: content),
        "Qwen3-0.6B": ("<|im_end|>", lambda content, last: ("<think>\n\n</think>\n\n" if last else "") + content),
        "Llama-3.2-1B-Instruct": ("<|eot_id|>", lambda content, last: content.strip())}


@pytest.mark.parametrize("model", sorted(REAL))
def test_mask_is_the_assistant_turns_on_real_templates(bpe, tmp_path, model):
    pytest.importorskip("jinja2")
    from test_chat_template import _hf_folder

    tokenizer = Tokenizer.load(_hf_folder(model, bpe, tmp_path))
    end, turn = REAL[model]
    assert tokenizer.end_of_turn_ids == (tokenizer.special_id(end),)
    rendered = render_example(Conversation(tuple(CONVERSATION), "x:1"), tokenizer)
    contents = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert assistant_texts(tokenizer, rendered) == [turn(c, i == len(contents) - 1) + end
                                                    for i, c in enumerate(contents)]


@pytest.mark.parametrize("model", ["chatml", *sorted(REAL)])
def test_a_prompt_completion_counts_only_the_completions_assistant_turns(chatml, bpe, tmp_path, model):
    """The prompt's assistant turn is rendered but not counted: the mask is the whole conversation's (the messages
    record's) from where the prompt ends, with its generation prompt."""
    if model == "chatml":
        tokenizer, (end, turn) = chatml, ("<|im_end|>", lambda content, last: content)
    else:
        pytest.importorskip("jinja2")
        from test_chat_template import _hf_folder

        tokenizer, (end, turn) = Tokenizer.load(_hf_folder(model, bpe, tmp_path)), REAL[model]
    whole = render_example(Conversation(tuple(CONVERSATION), "x:1"), tokenizer)
    rendered = render_example(Conversation(tuple(CONVERSATION), "x:1", trained_from=4), tokenizer)
    prompt_end = len(tokenizer.encode_chat(CONVERSATION[:4], add_generation_prompt=True))
    assert rendered.ids.tolist() == whole.ids.tolist()
    assert rendered.counted.tolist() == [counted and i >= prompt_end for i, counted in enumerate(whole.counted)]
    assert assistant_texts(tokenizer, rendered) == [turn(CONVERSATION[4]["content"], True) + end]
    assert len(assistant_texts(tokenizer, whole)) == 2  # the prompt's assistant turn, counted in a messages record


def test_a_template_without_the_prefix_property_is_refused(bpe):
    from scratchlm.tokenizer.chat_template import ChatTemplate

    # Renders each turn with the number of turns that follow it: a prefix is never a prefix of the whole.
    source = "{% for m in messages %}{{ m.role }}{{ messages|length }}: {{ m.content }}\n{% endfor %}"
    tokenizer = Tokenizer(*bpe, ["<|endoftext|>"]).with_chat_template(ChatTemplate(source))
    with pytest.raises(UserError, match="x:7: the chat template renders messages"):
        render_example(Conversation(tuple(CONVERSATION), "x:7"), tokenizer)


def test_a_completion_counts_the_completion_and_the_end(chatml):
    rendered = render_example(Completion("Q: 2+2=", " 4", "x:1"), chatml)
    assert assistant_texts(chatml, rendered) == [" 4<|endoftext|>"]


# ------------------------------------------------------------------------------------------------ packing
def example(ids: list[int], counted: list[bool]) -> Rendered:
    return Rendered(np.array(ids), np.array(counted), "x")


def test_packed_rows_keep_every_token_once_and_mask_across_documents():
    examples = [example([1, 2, 3], [0, 1, 1]), example([4, 5, 6, 7, 8], [0, 0, 1, 1, 1]), example([9, 10], [0, 1])]
    rows = build_rows(examples, 6, "packed")
    assert len(rows) == 2  # best fit: [5 tokens] and [3 + 2 tokens] in rows of 6
    kept = sorted(t for row, n in zip(rows.tokens.tolist(), rows.lengths.tolist()) for t in row[:n])
    assert kept == list(range(1, 11))
    batch = rows.batch(np.arange(2), "cpu")
    # the targets that count: each example's counted tokens after its first, never one of the next document
    counted = sorted(batch.targets[batch.targets != IGNORED].tolist())
    assert counted == [2, 3, 6, 7, 8, 10]
    assert rows.counted_targets == 6
    padded = build_rows(examples, 6, "padded")
    assert len(padded) == 3 and padded.batch(np.array([0, 2]), "cpu").inputs.shape == (2, 2)  # cut to 3 tokens


def test_row_sampler_resumes_exactly():
    rows = build_rows([example(list(range(1, n + 1)), [1] * n) for n in range(2, 12)], 12, "padded")
    sampler = RowSampler(rows, 3, "cpu", seed=5)
    for _ in range(4):
        sampler.next()
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [sampler.next().inputs.tolist() for _ in range(6)]  # crosses into the next epochs
    resumed = RowSampler(rows, 3, "cpu", seed=99)
    resumed.load_state_dict(state)
    assert [resumed.next().inputs.tolist() for _ in range(6)] == expected
    with pytest.raises(ValueError, match="batch_size"):
        RowSampler(rows, 2, "cpu", seed=5).load_state_dict(state)


# ------------------------------------------------------------------------------------------------ growth
@pytest.mark.parametrize("tied", [False, True])
def test_chatml_growth_appends_mean_rows(tied):
    config = ModelConfig.preset("tiny", vocab_size=10, tie_embeddings=tied)
    embedding, head = torch.randn(10, 64), torch.randn(10, 64)
    weights = {"token_embeddings.weight": embedding, "lm_head.weight": embedding if tied else head}
    grown = grow_vocabulary(config, weights, 9, [10, 11])  # id 9: an unused padding row, left as it was
    assert grown.vocab_size == 12
    for name, old in (("token_embeddings.weight", embedding), ("lm_head.weight", embedding if tied else head)):
        new = weights[name]
        assert new.shape == (12, 64) and torch.equal(new[:10], old)
        torch.testing.assert_close(new[10], old[:9].double().mean(0).float())
        assert torch.equal(new[10], new[11])
    assert (weights["token_embeddings.weight"] is weights["lm_head.weight"]) == tied


# ------------------------------------------------------------------------------------------------ builders
def test_hh_rlhf_dialogues_become_messages():
    from scratchlm.finetune.builders import dialogue_messages, hh_rlhf_conversations

    assert dialogue_messages("\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Bye") == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert dialogue_messages("\n\nHuman: Hi\n\nHuman: again\n\nAssistant: x") is None
    first = next(hh_rlhf_conversations(require_shared("chat/hh-rlhf/helpful-base/test.jsonl.gz")))
    assert first["messages"][0]["content"].startswith("Do you know why turkeys")
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"]


def test_tinystories_conversations_are_deterministic_and_tell_the_story():
    from itertools import islice

    from scratchlm.finetune.builders import tinystories_conversations

    path = require_shared("fixtures/tinystories_sample.txt")
    first = list(islice(tinystories_conversations(path, seed=1), 5))
    assert first == list(islice(tinystories_conversations(path, seed=1), 5))
    assert first != list(islice(tinystories_conversations(path, seed=2), 5))
    for conversation in first:
        user, assistant = conversation["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert "<|endoftext|>" not in assistant["content"]


def test_every_rank_resumes_from_rank_zeros_sampler_state():
    """Each rank draws its own permutation, but at the same step all stand at the same epoch and position: rank 0's
    saved state continues any rank (train/distributed.py restore_sampler)."""
    from scratchlm.train.distributed import restore_sampler

    rows = build_rows([example(list(range(1, n + 1)), [1] * n) for n in range(2, 12)], 12, "padded")
    zero, one = RowSampler(rows, 3, "cpu", seed=5, rank=0, world_size=2), RowSampler(rows, 3, "cpu", seed=5, rank=1,
                                                                                      world_size=2)
    for _ in range(5):
        zero.next(), one.next()
    resumed = RowSampler(rows, 3, "cpu", seed=5, rank=1, world_size=2)
    restore_sampler(resumed, zero.state_dict())
    assert [resumed.next().inputs.tolist() for _ in range(4)] == [one.next().inputs.tolist() for _ in range(4)]
