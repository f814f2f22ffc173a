"""Chat templates against transformers' ``apply_chat_template``, on the real templates of SmolLM2-135M-Instruct,
Qwen2.5-0.5B-Instruct, Qwen3-0.6B and Llama-3.2-1B-Instruct (shared/data/chat/templates) and plain ChatML.

The real vocabularies cannot be downloaded here, so each model gets a small byte-level BPE trained on TinyStories
with the model's added tokens (same texts, same special flags) and its tokenizer_config.json's template and named
tokens: a Hugging Face folder that both ``Tokenizer.load`` and ``transformers.AutoTokenizer`` read. Rendered text
and ids must be equal, for fixed conversations and hypothesis-made ones. Also: the template and end-of-turn ids
survive save/load (ours and HF's files), ``with_chatml``, content parts render as their joined texts, and bad
messages are one line naming the field.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import require_shared
from scratchlm.errors import UserError
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    check_messages,
)
from scratchlm.tokenizer.formats.io import AddedTokenFlags
from scratchlm.tokenizer.train_bpe import train_bpe

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("hf_offline_module")

MODELS = ["SmolLM2-135M-Instruct", "Qwen2.5-0.5B-Instruct", "Qwen3-0.6B", "Llama-3.2-1B-Instruct", "chatml"]
NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
# Llama 3.2's template writes today's date (strftime_now) unless given date_string: pinned so both sides agree.
EXTRA = {"Llama-3.2-1B-Instruct": {"date_string": "26 Jul 2024"}}

CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": "Once upon a time?"}],
    [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello. How can I help?"}, {"role": "user", "content": "A story, please."},
     {"role": "assistant", "content": "Tom had a red ball.\n\nThe end."}, {"role": "user", "content": "More"}],
    [{"role": "user", "content": "Say <|im_end|> and <|eot_id|> as text?"}],
    [{"role": "user", "content": "日本語 😀 naïve"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def bpe() -> tuple[dict, list]:
    return train_bpe(require_shared("fixtures/tinystories_sample.txt"), 600, [], num_workers=1)


def _real_config(model: str) -> dict:
    if model == "chatml":
        source = json.loads(require_shared("chat/templates/chatml/chatml.json").read_text())["chat_template"]
        return {"chat_template": source, "eos_token": "<|im_end|>",
                "added_tokens_decoder": {"0": {"content": "<|im_start|>", "special": True},
                                         "1": {"content": "<|im_end|>", "special": True}}}
    return json.loads(require_shared(f"chat/templates/{model}/tokenizer_config.json").read_text())


def _hf_folder(model: str, bpe: tuple[dict, list], folder: Path) -> Path:
    """A Hugging Face tokenizer folder: our BPE with the model's added tokens (tokenizer.json, written by us) and
    the model's template and named tokens (tokenizer_config.json, as the model has it)."""
    config = _real_config(model)
    added = sorted(config["added_tokens_decoder"].items(), key=lambda item: int(item[0]))
    specials = [entry["content"] for _, entry in added]
    flags = {entry["content"]: AddedTokenFlags(special=entry["special"], normalized=entry.get("normalized", False))
             for _, entry in added}
    Tokenizer(*bpe, specials, added_token_flags=flags).save(folder)
    (folder / "scratchlm-tokenizer.json").unlink()  # so load reads the HF files, as for a downloaded model
    hf_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                 "chat_template": config["chat_template"], **{name: config.get(name) for name in NAMED}}
    (folder / "tokenizer_config.json").write_text(json.dumps(hf_config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module", params=MODELS)
def pair(request, bpe, tmp_path_factory) -> tuple[str, Tokenizer, object]:
    """(model, our tokenizer, transformers' tokenizer) of one model's folder."""
    folder = _hf_folder(request.param, bpe, tmp_path_factory.mktemp(request.param))
    auto = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return request.param, Tokenizer.load(folder), auto


def _check_equal(model: str, ours: Tokenizer, auto, messages: list[dict], add_generation_prompt: bool) -> None:
    extra = EXTRA.get(model, {})
    text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    ids = auto.apply_chat_template(messages, tokenize=True, return_dict=False,
                                   add_generation_prompt=add_generation_prompt, **extra)
    assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra) == text
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra) == ids


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_rendering_equals_transformers(pair, conversation, add_generation_prompt):
    model, ours, auto = pair
    _check_equal(model, ours, auto, CONVERSATIONS[conversation], add_generation_prompt)


def test_template_options_reach_the_template(pair):
    """Keyword arguments are template variables, as in transformers (Qwen3's enable_thinking)."""
    model, ours, auto = pair
    messages = CONVERSATIONS[1]
    text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False,
                                    **EXTRA.get(model, {}))
    assert ours.render_chat(messages, add_generation_prompt=True, enable_thinking=False,
                            **EXTRA.get(model, {})) == text
    if model == "Qwen3-0.6B":
        assert text.endswith("<think>\n\n</think>\n\n")


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "description": "The city, e.g. Zürich"}},
                                             "required": ["city"]}}}


def test_tools_reach_the_template(pair):
    """Qwen's and Llama's templates write the tools' JSON schemas (tojson, with indent for Llama)."""
    model, ours, auto = pair
    messages = CONVERSATIONS[1]
    extra = EXTRA.get(model, {})
    text = auto.apply_chat_template(messages, tools=[TOOL], tokenize=False, add_generation_prompt=True, **extra)
    assert ours.render_chat(messages, tools=[TOOL], add_generation_prompt=True, **extra) == text
    if model.startswith(("Qwen", "Llama")):
        assert "get_weather" in text and "Zürich" in text


PIECES = ["Hello", " world", "\n", "\n\n", " ", "  ", "\t", "a cat", "!", "?", "<|im_end|>", "<|im_start|>",
          "<|eot_id|>", "<|endoftext|>", "<think>", "</think>", "é", "😀", "日本", "{{", "}}", "{%", "'", '"', "\\"]
content = st.one_of(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.text(max_size=40))


@st.composite
def conversations(draw) -> list[dict]:
    """An optional system message, then user and assistant turns alternating, ending with either."""
    messages = [{"role": "system", "content": draw(content)}] if draw(st.booleans()) else []
    turns = draw(st.integers(1, 6))
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": draw(content)} for i in range(turns)]
    return messages


@settings(max_examples=40, deadline=None)
@given(messages=conversations(), add_generation_prompt=st.booleans())
def test_rendering_equals_transformers_on_any_conversation(pair, messages, add_generation_prompt):
    model, ours, auto = pair
    _check_equal(model, ours, auto, messages, add_generation_prompt)


# ------------------------------------------------------------------------------------ files
def test_hf_folder_gives_template_named_tokens_and_end_of_turn(bpe, tmp_path):
    ours = Tokenizer.load(_hf_folder("Llama-3.2-1B-Instruct", bpe, tmp_path / "llama"))
    assert ours.chat_template.bos_token == "<|begin_of_text|>"
    assert ours.chat_template.eos_token == "<|eot_id|>"
    assert ours.end_of_turn_ids == (ours.special_id("<|eot_id|>"),)


def test_chat_template_jinja_wins_over_tokenizer_config(bpe, tmp_path):
    folder = _hf_folder("chatml", bpe, tmp_path / "chatml")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    ours = Tokenizer.load(folder)
    auto = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(messages) == auto.apply_chat_template(messages, tokenize=False) == "hi!"


def test_save_and_load_keep_template_and_end_of_turn(pair, tmp_path):
    model, ours, _ = pair
    ours.save(tmp_path / "saved")
    again = Tokenizer.load(tmp_path / "saved")  # scratchlm-tokenizer.json
    assert (again.chat_template, again.end_of_turn_ids) == (ours.chat_template, ours.end_of_turn_ids)
    assert again.hash == ours.hash
    (tmp_path / "saved" / "scratchlm-tokenizer.json").unlink()
    from_hf = Tokenizer.load(tmp_path / "saved")  # what we wrote for Hugging Face
    assert from_hf.chat_template == ours.chat_template
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    _check_equal(model, ours, auto, CONVERSATIONS[2], True)
    assert pickle.loads(pickle.dumps(ours)).chat_template == ours.chat_template


def test_with_chatml_appends_the_tokens_and_renders_as_transformers(bpe, tmp_path):
    base = Tokenizer(*bpe, ["<|endoftext|>"])
    chat = base.with_chatml()
    assert chat.special_tokens == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [chat.special_id("<|im_start|>"), chat.special_id("<|im_end|>")] == [base.vocab_size, base.vocab_size + 1]
    assert chat.end_of_turn_ids == (base.vocab_size + 1,)
    assert chat.chat_template.source == CHATML_TEMPLATE and chat.chat_template.eos_token == "<|endoftext|>"
    assert base.chat_template is None and base.end_of_turn_ids == ()
    assert chat.encode("Once upon a time") == base.encode("Once upon a time")
    assert chat.with_chatml().vocab_size == chat.vocab_size  # tokens it has are not added again
    chat.save(tmp_path / "chatml")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "chatml", local_files_only=True)
    for messages in CONVERSATIONS:
        _check_equal("chatml", chat, auto, messages, True)


def test_the_template_is_not_in_the_hash(bpe):
    plain = Tokenizer(*bpe, ["<|im_start|>", "<|im_end|>"])
    assert plain.with_chatml().hash == plain.hash
    assert Tokenizer(*bpe, []).with_chatml().hash != Tokenizer(*bpe, []).hash  # new tokens: a new vocabulary


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("messages", "message"), [
    ([], "messages: empty list"),
    ("hi", "messages: expected a list of messages, got str"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
     "messages[1].role: unknown role 'bot' (expected system, user, assistant, tool)"),
    ([{"content": "a"}], "messages[0].role: missing"),
    ([{"role": "user"}], "messages[0].content: missing"),
    ([{"role": "user", "content": 3}], "messages[0].content: expected a string or a list of text parts, got int"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[1].content[0].type: 'image_url' parts are not supported: this model reads text"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
     "messages[0].content[1].type: 'input_audio' parts are not supported"),
    ([{"role": "user", "content": [{"text": "a"}]}], 'messages[0].content[0].type: missing (expected "text")'),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text: expected a string, "
                                                                   "got int"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text: expected a string, got NoneType"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content[0]: expected a text part"),
    (["hi"], "messages[0]: expected an object with role and content, got str"),
])
def test_bad_messages_name_the_field(messages, message):
    with pytest.raises(UserError, match="^" + re.escape(message)):
        check_messages(messages)


def test_text_parts_are_their_texts_joined_by_newlines(pair):
    """OpenAI's list of content parts renders and encodes as the string of its texts joined by "\n" (vLLM's join
    for a text template), on every template."""
    model, ours, _ = pair
    texts = ["Tell me a story", "about a cat.", ""]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": text} for text in texts]},
             {"role": "assistant", "content": [{"type": "text", "text": "Tom"}, {"type": "text", "text": "sat."}]}]
    joined = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Tell me a story\nabout a cat.\n"},
              {"role": "assistant", "content": "Tom\nsat."}]
    assert check_messages(parts) == joined
    for add_generation_prompt in (False, True):
        options = {"add_generation_prompt": add_generation_prompt, **EXTRA.get(model, {})}
        assert ours.render_chat(parts, **options) == ours.render_chat(joined, **options)
        assert ours.encode_chat(parts, **options) == ours.encode_chat(joined, **options)


def test_a_template_that_refuses_says_why():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_is_refused_when_made():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_a_saved_template_that_does_not_compile_names_the_file(bpe, tmp_path):
    folder = _hf_folder("chatml", bpe, tmp_path / "hf")
    (folder / "chat_template.jinja").write_text("{% if %}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"chat_template.jinja: the chat template does not compile"):
        Tokenizer.load(folder)
    Tokenizer(*bpe, ["<|im_start|>", "<|im_end|>"]).with_chatml().save(tmp_path / "ours")
    path = tmp_path / "ours" / "scratchlm-tokenizer.json"
    document = json.loads(path.read_text())
    document["chat_template"]["source"] = "{% for %}"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"scratchlm-tokenizer.json: chat_template: the chat template does not"):
        Tokenizer.load(tmp_path / "ours")


def test_the_sandbox_refuses_reaching_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([{"role": "user", "content": "x"}])


def test_tojson_keeps_text_as_is():
    template = ChatTemplate("{{ messages[0] | tojson }}")
    assert template.render([{"role": "user", "content": "<é&>"}]) == '{"role": "user", "content": "<é&>"}'


def test_named_tokens_must_be_special_tokens(bpe):
    with pytest.raises(ValueError, match="eos_token '<|eot|>' is not a special token"):
        Tokenizer(*bpe, ["<|endoftext|>"], chat_template=ChatTemplate(CHATML_TEMPLATE, eos_token="<|eot|>"))
    with pytest.raises(ValueError, match="end-of-turn id 99999 is not in the vocabulary"):
        Tokenizer(*bpe, [], end_of_turn_ids=[99999])


def test_render_without_a_template_says_so(bpe):
    with pytest.raises(UserError, match="has no chat template"):
        Tokenizer(*bpe, []).render_chat([{"role": "user", "content": "x"}])
