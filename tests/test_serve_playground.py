"""The playground page in a real headless Chromium, driven over the DevTools protocol: type a prompt, press
Generate, and see the streamed text appear (the server's greedy completion) with the tokens/s line; in chat mode,
hold a conversation whose replies stream in.

Skipped without Chromium, but not in CI (CI set): .ci/run installs it, so there it must run (as the report's
browser check in tests/test_report.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from chat_helpers import IM_END, MESSAGES, SYSTEM, TOKENIZER, chat_model
from scratchlm.generate.decoding import generate
from serve_helpers import EOS, byte_tokenizer, serving, tiny_model

websockets_client = pytest.importorskip("websockets.sync.client", reason="the test extra's websockets is missing")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0"]


def _chromium() -> str:
    browser = next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))),
                   None)
    if browser is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail("CI is set but headless Chromium is not installed (.ci/run installs the Debian package "
                        "chromium); the playground's browser check cannot be skipped in CI")
        pytest.skip("headless Chromium not installed (apt-get install chromium)")
    return browser


class DevTools:
    """A minimal DevTools-protocol client for one page: send a command, wait for its answer."""

    def __init__(self, socket) -> None:
        self.socket = socket
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.evaluate(expression):
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {expression}")


def _page_socket(log: Path) -> str:
    """The page target's websocket URL, from the DevTools port Chromium writes to its log (stderr; a file, so
    that a chatty browser never blocks on a full pipe)."""
    import urllib.request

    deadline = time.monotonic() + 60
    while "DevTools listening on ws://" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise AssertionError(f"Chromium printed no DevTools address:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    line = next(line for line in log.read_text(errors="replace").splitlines() if "DevTools listening" in line)
    port = line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as answer:
            pages = [t for t in json.load(answer) if t["type"] == "page"]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.1)
    raise AssertionError("Chromium opened no page")


@contextmanager
def _browser_page(url: str, tmp_path: Path):
    """A headless Chromium showing the playground at url; yields the DevTools client of its page."""
    browser_path = _chromium()
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "chromium.log"
    with open(log, "wb") as stderr:
        browser = subprocess.Popen([browser_path, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                                    f"{url}/"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        with websockets_client.connect(_page_socket(log), max_size=None, open_timeout=30) as socket:
            page = DevTools(socket)
            page.wait_for("document.readyState === 'complete' && document.getElementById('generate') !== null")
            yield page
    finally:
        browser.kill()
        browser.wait(30)


def _type(page: DevTools, element: str, text: str) -> None:
    page.evaluate(f"document.getElementById('{element}').focus()")
    page.call("Input.insertText", text=text)  # typed, as a keyboard would


def _click(page: DevTools, selector: str) -> None:
    box = page.evaluate(f"(() => {{ const r = document.querySelector('{selector}').getBoundingClientRect();"
                        " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    for kind in ("mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


def test_typing_a_prompt_and_pressing_generate_streams_the_completion(tmp_path):
    model = tiny_model()
    model.lm_head.register_forward_pre_hook(lambda *_: time.sleep(0.02))  # each step: slow enough to watch
    tokens = generate(model, list(b"Once upon"), 40, temperature=0, eos_id=EOS)[0]
    expected = byte_tokenizer().decode(tokens)
    with serving(model) as (url, _), _browser_page(url, tmp_path) as page:
        page.evaluate("document.getElementById('temperature').value = '0';"
                      "document.getElementById('max_tokens').value = '40';")
        _type(page, "prompt", "Once upon")
        _click(page, "#generate")
        # Streaming: part of the text is on the page while the request is still running (the button is
        # disabled until the stream ends).
        partial = page.wait_for("(() => { const t = document.getElementById('completion').textContent;"
                                " return document.getElementById('generate').disabled && t ? t : ''; })()")
        stats = page.wait_for("(() => { const s = document.getElementById('stats').textContent;"
                              " return s.includes(' in ') ? s : ''; })()")
        shown = page.evaluate("document.getElementById('completion').textContent")
        prompt = page.evaluate("document.querySelector('#output .prompt').textContent")
        error = page.evaluate("document.getElementById('error').textContent")
    assert error == ""
    assert prompt == "Once upon" and shown == expected and expected.startswith(partial) and partial != expected
    assert "tokens/s" in stats and stats.startswith(f"{len(tokens)} tokens")


REPLIES = "[...document.querySelectorAll('#conversation .assistant')].map((turn) => turn.textContent)"
DONE = "!document.getElementById('send').disabled && document.getElementById('stats').textContent.includes(' in ')"


def test_chat_mode_holds_a_conversation_with_streamed_replies(tmp_path):
    """Chat mode: a system message and two user turns, each reply streamed from /v1/chat/completions and equal
    to the engine's greedy reply to the conversation so far (ending at <|im_end|>); Reset empties it; a model
    without a chat template gets the server's message on the page."""
    model = chat_model()
    model.lm_head.register_forward_pre_hook(lambda *_: time.sleep(0.1))
    history = list(MESSAGES)
    expected = []
    for user in (None, "More"):  # None: MESSAGES' own user turn
        if user is not None:
            history += [{"role": "assistant", "content": expected[-1]}, {"role": "user", "content": user}]
        new = generate(model, TOKENIZER.encode_chat(history, add_generation_prompt=True), 40, temperature=0,
                       eos_id=IM_END)[0]
        expected.append(TOKENIZER.decode(new))
    with serving(model, tokenizer=TOKENIZER) as (url, _), _browser_page(url, tmp_path) as page:
        _click(page, "input[value=chat]")
        assert page.evaluate("document.getElementById('prompt').offsetParent === null")  # completion mode hidden
        page.evaluate("document.getElementById('temperature').value = '0';"
                      "document.getElementById('max_tokens').value = '40';")
        _type(page, "system", SYSTEM)
        _type(page, "message", MESSAGES[1]["content"])
        _click(page, "#send")
        partial = page.wait_for(f"(() => {{ const r = {REPLIES}; return document.getElementById('send').disabled"
                                " && r.length && r[0] ? r[0] : ''; })()")
        page.wait_for(DONE)
        page.evaluate("document.getElementById('stats').textContent = ''")
        _type(page, "message", "More")
        _click(page, "#send")
        page.wait_for(DONE)
        replies = page.evaluate(REPLIES)
        users = page.evaluate("[...document.querySelectorAll('#conversation .user')].map((t) => t.textContent)")
        error = page.evaluate("document.getElementById('error').textContent")
        _click(page, "#reset")
        emptied = page.evaluate("document.querySelectorAll('#conversation .turn').length")
    assert error == "" and users == ["A story?", "More"]
    assert replies == expected and expected[0].startswith(partial) and partial != expected[0]
    assert emptied == 0
    with serving() as (url, _), _browser_page(url, tmp_path / "plain") as page:  # a base model: no template
        _click(page, "input[value=chat]")
        _type(page, "message", "Hi")
        _click(page, "#send")
        error = page.wait_for("document.getElementById('error').textContent")
        kept = page.evaluate("document.getElementById('message').value")
    assert "has no chat template" in error and kept == "Hi"
