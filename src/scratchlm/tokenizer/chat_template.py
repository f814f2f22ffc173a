"""Chat templates: a conversation (a list of ``{"role", "content"}`` messages) rendered as the text a chat model was
trained on, with the semantics of transformers' ``apply_chat_template``.

A chat template is Jinja2 source, as Hugging Face stores it (``"chat_template"`` in tokenizer_config.json, or a
``chat_template.jinja`` file). It sees::

    messages               the conversation, each message a dict (role, content, and any other keys given)
    add_generation_prompt  true to end with the header of an assistant turn (what a model then completes)
    tools, documents       None unless given (Llama 3.2's template tests ``tools is not none``)
    bos_token, eos_token,  the tokenizer's named special tokens as strings, those it has
    unk_token, pad_token
    anything else          keyword arguments of ``render`` (Llama 3.2's ``date_string``, Qwen3's ``enable_thinking``)

It renders in the environment transformers 5 builds (``utils/chat_template_utils.py``): a sandbox (templates from
the Hub are untrusted code) with ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that is
``json.dumps``, and ``raise_exception``, ``strftime_now`` and ``namespace``; ``{% generation %}`` renders its body.
``render`` + ``Tokenizer.encode`` give the ids of ``apply_chat_template(..., tokenize=True)``
(tests/test_chat_template.py checks text and ids on the real templates).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from functools import lru_cache

from scratchlm.errors import UserError

# Roles a message may have: OpenAI's chat roles. (A template decides what it does with each; Qwen's turn "tool" into
# a user turn, Llama 3.2's into an "ipython" header.)
ROLES = ("system", "user", "assistant", "tool")

# Plain ChatML with no default system prompt: shared/data/chat/templates/chatml (mistral.rs's chatml.json).
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"


class ChatTemplateError(UserError, ValueError):
    """A template that does not compile, or that refused a conversation (its ``raise_exception``); a ValueError
    too, so that a file reader names the file holding a template that does not compile."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja2 chat template and the named special tokens it is rendered with.

    ``source`` is the template text exactly as transformers stores it. The token fields are the strings of the
    tokenizer's named special tokens (tokenizer_config.json's ``bos_token`` ...), None where it has none: the
    template sees them as ``bos_token`` and so on, as transformers passes ``tokenizer.special_tokens_map``.
    (``sep_token``, ``cls_token`` and ``mask_token`` belong to encoder models and are not kept.)
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"a chat template's source must be non-empty Jinja2 text, got {self.source!r}")
        for name in NAMED_TOKENS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"chat template {name} must be a string or None, got {value!r}")
        _compiled(self.source)  # a template that does not compile fails here, not at the first request

    @property
    def named_tokens(self) -> dict[str, str]:
        """{"bos_token": ..., ...} for the named tokens that are set: what the template sees besides messages."""
        return {name: getattr(self, name) for name in NAMED_TOKENS if getattr(self, name) is not None}

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, tools: list[dict] | None = None,
               **extra: object) -> str:
        """The text of the conversation (``check_messages`` first); ``add_generation_prompt`` ends it with the start
        of an assistant turn. extra are further template variables (they override a named token of the same name,
        as in transformers). A template's ``raise_exception`` becomes a ChatTemplateError with its message."""
        import jinja2

        messages = check_messages(messages)
        variables = {**self.named_tokens, **extra}
        try:
            return _compiled(self.source).render(messages=messages, tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as error:  # raise_exception, or a sandbox refusal
            raise ChatTemplateError(f"the chat template refused the conversation: {error}") from None


NAMED_TOKENS = tuple(field.name for field in fields(ChatTemplate) if field.name.endswith("_token"))


def check_messages(messages: object, where: str = "messages") -> list[dict]:
    """The messages as a list of plain dicts, each with a known ``role`` and a string ``content`` (a list of text
    parts becomes that string: ``_content_text``); otherwise a UserError naming the field (``messages[2].role:
    unknown role 'bot' ...``). Other keys of a message pass through; a key whose value is None is dropped, as
    transformers drops it (an API's ``"name": null``)."""
    if not isinstance(messages, list | tuple):
        raise UserError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise UserError(f"{where}: empty list; a conversation needs at least one message")
    checked = []
    for index, message in enumerate(messages):
        place = f"{where}[{index}]"
        if not isinstance(message, Mapping):
            raise UserError(f"{place}: expected an object with role and content, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role")
        if role is None:
            raise UserError(f"{place}.role: missing (expected {', '.join(ROLES)})")
        if role not in ROLES:
            raise UserError(f"{place}.role: unknown role {role!r} (expected {', '.join(ROLES)})")
        if "content" not in message:
            raise UserError(f"{place}.content: missing (expected a string or a list of text parts)")
        message["content"] = _content_text(message["content"], f"{place}.content")
        checked.append(message)
    return checked


def _content_text(content: object, place: str) -> str:
    """A message's content as the string the template sees: a string as it is, or OpenAI's list of text parts
    (``[{"type": "text", "text": "..."}, ...]``) joined by "\n", as vLLM joins them for a string-content template
    (transformers would pass the list on, which a text template such as ChatML cannot render)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise UserError(f"{place}: expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        where = f"{place}[{index}]"
        if not isinstance(part, Mapping):
            raise UserError(f"{where}: expected a text part {{\"type\": \"text\", \"text\": ...}}, got "
                            f"{type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise UserError(f'{where}.type: missing (expected "text")' if kind is None else
                            f"{where}.type: {kind!r} parts are not supported: this model reads text")
        if not isinstance(part.get("text"), str):
            raise UserError(f"{where}.text: expected a string, got {type(part.get('text')).__name__}")
        texts.append(part["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------- the environment
@lru_cache(maxsize=16)
def _compiled(source: str):
    """The compiled template (cached: a server renders with one template many times)."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error.message} (line {error.lineno})") from None


@lru_cache(maxsize=1)
def _environment():
    """transformers' environment for chat templates, rebuilt from its documented behaviour (see the module)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, _generation_block_class()])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _namespace_class()
    return environment


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja's own tojson escapes <, > and & for HTML; a prompt wants the JSON itself."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _namespace_class():
    """Jinja's ``namespace``, refusing attribute names that start with ``_`` (a sandbox escape route)."""
    import jinja2.utils
    from jinja2.exceptions import SecurityError

    def checked(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store {name!r} on a namespace (a name starting with _)")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature: namespace(self=...) must still work
            self, args = args[0], args[1:]
            attributes = dict(*args, **kwargs)
            for name in attributes:
                checked(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name, value):
            checked(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _generation_block_class():
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body; transformers records where, we need not."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    return GenerationBlock

