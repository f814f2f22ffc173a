"""Imported instruct models keep their chat template and end-of-turn ids, chat over the API as transformers would,
and export them back so that transformers' apply_chat_template and generate() work on the export.

Each model is a tiny random Qwen2 / Qwen3 / Llama (hf_models.py) saved by transformers beside a byte tokenizer
with the real model's template, named tokens and the added tokens its template uses (shared/data/chat/templates),
and a generation_config.json listing the ids that end a turn, as the real models ship; its weights are set so that
its greedy reply ends after three tokens (transformers' `generate` stops there). `scratchlm import hf` -> the run's
tokenizer carries the template and those ids -> the server's `usage.prompt_tokens` is the length of transformers'
`apply_chat_template(..., add_generation_prompt=True)` and its reply is transformers' greedy reply, ending with
finish_reason "stop" -> `scratchlm export hf` -> transformers renders as before and `generate` stops there too.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import require_shared
from hf_models import hf_config, hf_model
from scratchlm.cli import main
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.hf import write_hf_tokenizer
from scratchlm.tokenizer.formats.io import AddedTokenFlags
from scratchlm.train.checkpoint import load_for_inference
from serve_helpers import MODEL_NAME, serving

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai", reason="the test extra's openai client is not installed")
pytestmark = pytest.mark.usefixtures("hf_offline_one_thread")

NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
# (tiny shape, real template, the tokens generation_config.json ends a generation at; the first is the one the
# test's model ends its reply with: a token the prompt never holds, so that its (tied) row is free to set)
MODELS = {
    "qwen2.5": ("qwen2.5", "Qwen2.5-0.5B-Instruct", ["<|endoftext|>", "<|im_end|>"]),
    "qwen3": ("qwen3-0.6b", "Qwen3-0.6B", ["<|endoftext|>", "<|im_end|>"]),
    "llama-3.2": ("llama-3.2-1b", "Llama-3.2-1B-Instruct", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
}
TURN = 3  # the model ends its reply after this many tokens
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": "Once there was a cat."}, {"role": "user", "content": "And then?"}]


def _hf_chat_folder(folder, name: str):
    """A transformers-saved tiny model with a byte tokenizer carrying the real template; returns (folder, the ids
    generation_config.json names)."""
    shape, template, stops = MODELS[name]
    config = json.loads(require_shared(f"chat/templates/{template}/tokenizer_config.json").read_text())
    named = {key: config.get(key) for key in NAMED}
    added = [entry for _, entry in sorted(config["added_tokens_decoder"].items(), key=lambda item: int(item[0]))
             if entry["content"] in config["chat_template"] or entry["content"] in [*named.values(), *stops]]
    specials = [entry["content"] for entry in added]
    flags = {entry["content"]: AddedTokenFlags(entry["special"], entry.get("normalized", False)) for entry in added}
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], specials, added_token_flags=flags)
    hf_settings = hf_config(shape)
    hf_settings.max_position_embeddings = 512  # a conversation in bytes, with a default system prompt
    hf_model(hf_settings).save_pretrained(folder)
    write_hf_tokenizer(folder, tokenizer)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                        "chat_template": config["chat_template"], **named}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    stop_ids = [tokenizer.special_id(token) for token in stops]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_ids}), encoding="utf-8")
    return folder, stop_ids


def _ending_turn(hf, prompt: list[int], stop: int, vocab: int) -> list[int]:
    """Make `hf` reply to `prompt` (greedy) with TURN tokens and then `stop`: the output row of `stop` scores -1000
    at the positions that predict the reply and +1000 after it (a least-squares row through those final hidden
    states); returns the reply. The row is tied to the input embedding, which only a prompt holding `stop` reads."""
    beyond = list(range(vocab, hf.config.vocab_size))
    with torch.no_grad():
        reply = hf.generate(torch.tensor([prompt]), max_new_tokens=TURN, min_new_tokens=TURN, do_sample=False,
                            pad_token_id=0, suppress_tokens=beyond + [stop])[0, len(prompt):].tolist()
        seen = []
        handle = hf.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
        hf(torch.tensor([prompt + reply]))
        handle.remove()
        hidden = seen[0][0, len(prompt) - 1:]  # (TURN + 1, d)
        target = torch.full((TURN + 1, 1), -1000.0)
        target[-1] = 1000.0
        hf.lm_head.weight[stop] = torch.linalg.lstsq(hidden, target).solution[:, 0]
    return reply


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_instruct_model_chats_as_transformers_and_exports_its_template(tmp_path, capsys, name):
    folder, stop_ids = _hf_chat_folder(tmp_path / "hf", name)
    auto = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    expected = auto.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                           local_files_only=True).eval()
    assert stop_ids[0] not in expected
    reply = _ending_turn(hf, expected, stop_ids[0], len(auto))
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_ids}), encoding="utf-8")
    beyond = list(range(len(auto), hf.config.vocab_size))  # ids we never sample: they have no text
    with torch.no_grad():  # greedy, stopping where generation_config.json says
        theirs = hf.generate(torch.tensor([expected]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             suppress_tokens=beyond)[0, len(expected):].tolist()
    assert theirs == reply + [stop_ids[0]]  # transformers stops at the end of the turn

    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 0
    model, config = load_for_inference(tmp_path / "run")
    tokenizer = Tokenizer.load(config.data.tokenizer)
    source = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert tokenizer.chat_template.source == source
    assert set(tokenizer.end_of_turn_ids) == set(stop_ids)
    with serving(model, tokenizer=tokenizer) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert response.usage.prompt_tokens == len(expected)
    assert response.choices[0].message.content == tokenizer.decode(reply)
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == TURN

    capsys.readouterr()
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "back", local_files_only=True)
    for add_generation_prompt in (False, True):
        assert back.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False) \
            == auto.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    stops = transformers.GenerationConfig.from_pretrained(tmp_path / "back").eos_token_id
    assert set(stop_ids) <= set(stops if isinstance(stops, list) else [stops])
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    with torch.no_grad():  # generate() on the export stops where the original does
        again = exported.generate(torch.tensor([expected]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  suppress_tokens=beyond)[0, len(expected):].tolist()
    assert again == reply + [stop_ids[0]]


def test_a_model_without_a_template_imports_without_one(tmp_path):
    folder, _ = _hf_chat_folder(tmp_path / "hf", "qwen2.5")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 0
    tokenizer = Tokenizer.load(tmp_path / "run" / "tokenizer")
    assert tokenizer.chat_template is None and tokenizer.end_of_turn_ids == ()
