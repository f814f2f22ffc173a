"""`scratchlm chat RUN` driven through its stdin, as a person types: each line a user message, replies streamed
to stdout, each ending at the end of the model's turn; the conversation carries over from turn to turn, /reset
starts it over (keeping --system), /exit ends. Each reply equals what the engine decodes after the rendered
conversation (generate() up to <|im_end|>). A model without a chat template is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chat_helpers import IM_END, MESSAGES, PROMPT, SYSTEM, TOKENIZER, TURN, chat_model
from scratchlm.compat.commands import write_run
from scratchlm.generate.chat import ChatSession
from scratchlm.generate.decoding import generate

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread_module")


def _reply(model, messages: list[dict]) -> str:
    """The oracle: greedy generate() after the rendered conversation, up to the end of the turn."""
    prompt = TOKENIZER.encode_chat(messages, add_generation_prompt=True)
    budget = min(256, model.config.context_length + 1 - len(prompt))
    new = generate(model, prompt, budget, temperature=0, eos_id=IM_END)[0]
    return TOKENIZER.decode(new)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "run"
    write_run(chat_model(), TOKENIZER, folder)
    return folder


def test_a_conversation_through_stdin(run):
    model = chat_model()
    first = _reply(model, MESSAGES)
    assert first == TOKENIZER.decode(generate(model, PROMPT, TURN, temperature=0)[0])
    second = _reply(model, [*MESSAGES, {"role": "assistant", "content": first}, {"role": "user", "content": "More"}])
    environment = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONIOENCODING": "utf-8"}
    typed = "A story?\nMore\n/reset\n\n/nope\nA story?\n/exit\nnever read\n"
    done = subprocess.run([sys.executable, "-m", "scratchlm", "chat", str(run), "--system", SYSTEM,
                           "--temperature", "0", "--device", "cpu"], input=typed, capture_output=True,
                          text=True, encoding="utf-8", env=environment, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{first}\n{second}\n{first}\n"
    assert "(conversation reset)" in done.stderr and "unknown command /nope (/reset, /exit)" in done.stderr


def test_the_session_keeps_the_conversation_and_seeds_each_reply(run):
    model = chat_model()
    session = ChatSession(model, TOKENIZER, system=SYSTEM, temperature=0)
    assert "".join(session.reply("A story?")) == _reply(model, MESSAGES)
    assert session.finish_reason == "stop" and [m["role"] for m in session.messages] == ["system", "user",
                                                                                          "assistant"]
    sampled = ChatSession(model, TOKENIZER, seed=3, max_new_tokens=5)
    again = ChatSession(model, TOKENIZER, seed=3, max_new_tokens=5)
    assert ["".join(sampled.reply(t)) for t in ("a", "b")] == ["".join(again.reply(t)) for t in ("a", "b")]
    session.reset()
    assert session.messages == MESSAGES[:1]


def test_a_conversation_too_long_for_the_context_says_reset(run):
    session = ChatSession(chat_model(), TOKENIZER, temperature=0)
    with pytest.raises(Exception, match="too long for the model's context of 128 .*: /reset starts over"):
        list(session.reply("x" * 200))
    assert session.messages == []
