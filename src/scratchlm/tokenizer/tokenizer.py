"""Byte-level BPE Tokenizer: encode, decode, streaming encode, special tokens, chat.

``encode`` splits the text on special tokens (at the leftmost match, the longest), each of which becomes its id and
is never merged; the ordinary pieces between them go to a ``bpe.PieceEncoder``, which pre-tokenizes them under the
tokenizer's ``pipeline.Pipeline`` and runs BPE on each pre-token: ``bpe.ReadableBPE`` with ``fast=False``, else
``fast.CachedBPE`` (the same ids, much faster). ``encode_stream`` buffers chunks and encodes all but a held-back
tail that more text could still change (``_split_stable_prefix``), so its output equals ``encode`` of the whole.
A chat template (``chat_template.py``) and the ids that end an assistant turn ride along for ``render_chat`` and
``encode_chat``; ``encode`` never looks at them. Files are read and written by ``formats/``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

from scratchlm.errors import UserError
from scratchlm.tokenizer.bpe import PieceEncoder, ReadableBPE, merge_table
from scratchlm.tokenizer.chat_template import CHATML_END, CHATML_START, CHATML_TEMPLATE, ChatTemplate
from scratchlm.tokenizer.formats.hf import EOS_TOKEN
from scratchlm.tokenizer.formats.io import FlagsByToken, checked_flags, invert_vocab
from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.tokenizer.pretokenize import (
    has_known_boundaries,
    last_space_boundary,
    line_start_boundary,
    special_token_regex,
    split_on_special_tokens,
    split_pretokens,
    validate_special_tokens,
)

# A pre-token match never depends on text more than this many characters past its end (the GPT-2 pattern
# looks at most 3 characters ahead: the contraction "'ll" tried at a match's last character).
_LOOKAHEAD_CHARS = 3


class Tokenizer:
    """Byte-level BPE over ``vocab`` (id -> bytes) and ``merges`` (in creation order), plus special tokens, under a
    ``pipeline`` (normalizer, split pattern, ignore_merges: GPT-2's by default).

    ``fast=True`` (the default) encodes through ``tokenizer/fast/`` (caches of at most ``cache_size`` entries);
    ``fast=False`` through ``bpe.ReadableBPE``, the plain rule: the same ids, for reading and testing.
    ``added_token_flags`` keeps how a Hugging Face file marked some special tokens (``formats/io.py``): they
    change no id, only the tokenizer.json that ``save`` writes.
    ``chat_template`` (a ``ChatTemplate`` whose named tokens are special tokens of this tokenizer, or None) renders a
    conversation as text (``render_chat``); ``end_of_turn_ids`` are the ids that end an assistant turn (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``): a decoder answering in a chat stops at them. ``with_chat_template``
    and ``with_chatml`` give a tokenizer both.
    """

    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: list[str] | None = None, *, pipeline: Pipeline = GPT2_PIPELINE, fast: bool = True,
                 cache_size: int = 100_000, added_token_flags: FlagsByToken | None = None,
                 chat_template: ChatTemplate | None = None, end_of_turn_ids: Iterable[int] = ()) -> None:
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"pipeline must be a tokenizer.pipeline.Pipeline, got {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.vocab: dict[int, bytes] = dict(vocab)
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_tokens: list[str] = validate_special_tokens(special_tokens)
        self.added_token_flags: FlagsByToken = checked_flags(added_token_flags, self.special_tokens)
        self._bytes_to_id = invert_vocab(self.vocab)
        self._byte_ids = _single_byte_ids(self._bytes_to_id)
        self._special_ids = self._add_special_tokens()
        self._special_regex = special_token_regex(self.special_tokens)
        self._special_prefixes = {token[:k] for token in self.special_tokens for k in range(1, len(token))}
        self._max_special_prefix = max((len(p) for p in self._special_prefixes), default=0)
        self._cache_size = cache_size
        self.fast = fast
        table = merge_table(self.merges, self._bytes_to_id)
        tokens = self._ordinary_tokens() if pipeline.ignore_merges else None
        if fast:  # imported only when asked for: it brings numpy
            from scratchlm.tokenizer.fast import CachedBPE

            self._bpe: PieceEncoder = CachedBPE(table, self._byte_ids, cache_size, pipeline, tokens)
        else:
            self._bpe = ReadableBPE(table, self._byte_ids, pipeline, tokens)
        self._hash: str | None = None
        self.chat_template, self.end_of_turn_ids = self._checked_chat(chat_template, end_of_turn_ids)

    # ------------------------------------------------------------------ construction and identity
    @classmethod
    def from_files(cls, vocab_path: str | Path, merges_path: str | Path | None = None,
                   special_tokens: list[str] | None = None, *, fast: bool = True) -> Tokenizer:
        """Read GPT-2 ``vocab.json`` + ``merges.txt``, or with merges_path=None one file that holds its own merges:
        ``scratchlm-tokenizer.json`` or a Hugging Face byte-level BPE ``tokenizer.json``."""
        from scratchlm.tokenizer.formats.folder import read_tokenizer_files

        vocab, merges, specials, pipeline, flags, chat = read_tokenizer_files(vocab_path, merges_path)
        if special_tokens is not None:  # the caller's list replaces the file's, and its flags and chat with none
            specials, flags, chat = special_tokens, {}, (None, ())
        return cls._built_from(vocab_path, vocab, merges, specials, pipeline, flags, chat, fast)

    @classmethod
    def load(cls, directory: str | Path, *, fast: bool = True) -> Tokenizer:
        """Read a directory written by ``save``, a Hugging Face tokenizer folder, or GPT-2 ``vocab.json`` +
        ``merges.txt`` (the order of the files is in ``formats/folder.py``)."""
        from scratchlm.tokenizer.formats.folder import read_tokenizer_dir

        vocab, merges, specials, pipeline, flags, chat = read_tokenizer_dir(directory)
        return cls._built_from(directory, vocab, merges, specials, pipeline, flags, chat, fast)

    @classmethod
    def _built_from(cls, source: str | Path, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                    special_tokens: list[str], pipeline: Pipeline, flags: FlagsByToken,
                    chat: tuple[ChatTemplate | None, tuple[int, ...]], fast: bool) -> Tokenizer:
        """A tokenizer from what was read at source; an inconsistency (say a merge whose result is not in the
        vocab) names the file or folder it came from."""
        template, end_of_turn_ids = chat
        try:
            return cls(vocab, merges, special_tokens, pipeline=pipeline, fast=fast, added_token_flags=flags,
                       chat_template=template, end_of_turn_ids=end_of_turn_ids)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    def save(self, directory: str | Path) -> Path:
        """Write ``scratchlm-tokenizer.json``, Hugging Face's ``tokenizer.json`` + ``tokenizer_config.json`` and GPT-2
        ``vocab.json`` + ``merges.txt`` into directory (a format that cannot hold this tokenizer is left out)."""
        from scratchlm.tokenizer.formats.folder import write_tokenizer_dir

        return write_tokenizer_dir(directory, self)

    # ------------------------------------------------------------------ chat
    def with_chat_template(self, template: ChatTemplate | str, *, end_of_turn: Iterable[str | int] = (),
                           special_tokens: Iterable[str] = ()) -> Tokenizer:
        """A copy of this tokenizer that carries template and ends a turn at the end_of_turn tokens (each a token's
        text, made a special token, or an id in the vocab).

        special_tokens (and the end_of_turn texts) are made special tokens; those it lacks get new ids after the
        current vocab, in order (the model's embedding must then grow by as many rows). A template given as text
        gets ``eos_token`` "<|endoftext|>" when this tokenizer has it, as the saved tokenizer_config.json names it.
        """
        end_of_turn = list(end_of_turn)
        texts = [token for token in end_of_turn if isinstance(token, str)]
        specials = self.special_tokens + [token for token in dict.fromkeys([*special_tokens, *texts])
                                          if token not in self.special_tokens]
        if isinstance(template, str):
            template = ChatTemplate(template, eos_token=EOS_TOKEN if EOS_TOKEN in specials else None)
        if specials == self.special_tokens:  # the same ids: share the encoder (a large vocab builds in seconds)
            grown = copy.copy(self)
        else:
            grown = Tokenizer(self.vocab, self.merges, specials, pipeline=self.pipeline, fast=self.fast,
                              cache_size=self._cache_size, added_token_flags=self.added_token_flags)
        grown.chat_template, grown.end_of_turn_ids = grown._checked_chat(
            template, [grown.special_id(token) if isinstance(token, str) else token for token in end_of_turn])
        return grown

    def with_chatml(self) -> Tokenizer:
        """A copy with ChatML: special tokens ``<|im_start|>`` and ``<|im_end|>`` (new ids after the vocab where it
        lacks them), the plain ChatML template (no default system prompt), and ``<|im_end|>`` ending a turn."""
        return self.with_chat_template(CHATML_TEMPLATE, end_of_turn=[CHATML_END],
                                       special_tokens=[CHATML_START, CHATML_END])

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = False, **extra: object) -> str:
        """The conversation as the text the chat template makes of it (``ChatTemplate.render``); a UserError when
        this tokenizer has no template."""
        if self.chat_template is None:
            raise UserError("this model's tokenizer has no chat template (a base model: `scratchlm finetune` makes "
                            "it a chat model, with ChatML)")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = False, **extra: object) -> list[int]:
        """The ids of ``render_chat`` (special tokens recognised): transformers' ``apply_chat_template(...,
        tokenize=True)``."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra))

    def _checked_chat(self, template: ChatTemplate | None,
                      end_of_turn_ids: Iterable[int]) -> tuple[ChatTemplate | None, tuple[int, ...]]:
        """(template, end-of-turn ids) after checking that the template's named tokens are special tokens here (a
        saved tokenizer_config.json names them, and transformers would add one it does not find) and that each
        end-of-turn id is in the vocab."""
        if template is not None and not isinstance(template, ChatTemplate):
            raise TypeError(f"chat_template must be a ChatTemplate or None, got {type(template).__name__}")
        for name, token in (template.named_tokens.items() if template else ()):
            if token not in self._special_ids:
                raise ValueError(f"the chat template's {name} {token!r} is not a special token of this tokenizer "
                                 f"(special tokens: {self.special_tokens})")
        end_of_turn_ids = tuple(end_of_turn_ids)
        bad = next((token_id for token_id in end_of_turn_ids
                    if type(token_id) is not int or token_id not in self.vocab), None)
        if bad is not None:
            raise ValueError(f"end-of-turn id {bad!r} is not in the vocabulary (ids 0..{self.vocab_size - 1})")
        return template, end_of_turn_ids

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (the embedding table size a model needs)."""
        return max(self.vocab) + 1 if self.vocab else 0

    @property
    def hash(self) -> str:
        """sha256 hex digest of the canonical (vocab, merges, special tokens, pipeline); token files and runs record
        it. Of the content, never of a file, so a file's name or format never changes a recorded identity; GPT-2's
        pipeline adds no line, so hashes recorded before pipelines existed keep their meaning. The chat template and
        end-of-turn ids change no id of any text and are not in it (``with_chatml``'s new special tokens are)."""
        if self._hash is None:
            vocab = self.vocab
            lines = [f"v{token_id}:{vocab[token_id].hex()}\n" for token_id in sorted(vocab)]
            lines += [f"m{left.hex()} {right.hex()}\n" for left, right in self.merges]
            lines += [f"s{token.encode('utf-8').hex()}\n" for token in self.special_tokens]
            lines += self.pipeline.identity_lines()
            self._hash = hashlib.sha256("".join(lines).encode("ascii")).hexdigest()
        return self._hash

    def special_id(self, token: str) -> int:
        """The id of a registered special token."""
        try:
            return self._special_ids[token]
        except KeyError:
            raise ValueError(f"{token!r} is not a special token of this tokenizer "
                             f"(special tokens: {self.special_tokens})") from None

    @property
    def end_of_text_id(self) -> int | None:
        """The id of <|endoftext|>, which ends a document (and starts a new one); None when it is no special token."""
        return self._special_ids.get(EOS_TOKEN)

    def __repr__(self) -> str:
        pipeline = "" if self.pipeline == GPT2_PIPELINE else f", pipeline={self.pipeline}"
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens}{pipeline})")

    def __getstate__(self) -> dict:
        # Workers rebuild the lookup tables; the cache is per process.
        return {"vocab": self.vocab, "merges": self.merges, "special_tokens": self.special_tokens,
                "pipeline": self.pipeline, "fast": self.fast, "cache_size": self._cache_size,
                "added_token_flags": self.added_token_flags, "chat_template": self.chat_template,
                "end_of_turn_ids": self.end_of_turn_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # ------------------------------------------------------------------ encoding
    def clear_cache(self) -> None:
        """Forget the fast path's pre-token and word caches (ids are unchanged; the next encodes run BPE afresh)."""
        self._bpe.clear()

    def encode(self, text: str) -> list[int]:
        """Token ids of text; registered special tokens in the text become their ids and are never split."""
        _check_text(text)
        try:
            return self._encode_text(text)
        except UnicodeEncodeError:
            raise ValueError(_unencodable_message(text, 0)) from None

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of text with special tokens treated as plain text (tiktoken's ``encode_ordinary``)."""
        _check_text(text)
        ids: list[int] = []
        try:
            self._bpe.encode(text, ids)
        except UnicodeEncodeError:
            raise ValueError(_unencodable_message(text, 0)) from None
        return ids

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily yield the ids of the concatenated strings (e.g. a file read line by line); equals ``encode``."""
        return chain.from_iterable(self.encode_stream(iterable))

    def encode_stream(self, iterable: Iterable[str], *, chunk_chars: int = 1 << 16) -> Iterator[list[int]]:
        """Like ``encode_iterable`` but yields lists of ids, one per buffered chunk of about ``chunk_chars``."""
        parts: list[str] = []
        buffered = 0
        offset = 0  # characters already encoded, for error positions
        threshold = chunk_chars
        for text in iterable:
            parts.append(text)
            buffered += len(text)
            if buffered < threshold:
                continue
            buffer = "".join(parts)
            try:
                ids, rest = self._split_stable_prefix(buffer)
            except UnicodeEncodeError:
                raise ValueError(_unencodable_message(buffer, offset)) from None
            offset += len(buffer) - len(rest)
            parts, buffered = [rest], len(rest)
            # A held-back tail is pre-tokenized again with the next text: when it is long (one pre-token of
            # megabytes: a line of DNA), wait for twice as much, so the repeated work stays linear in all.
            threshold = max(chunk_chars, 2 * len(rest))
            if ids:
                yield ids
        buffer = "".join(parts)
        try:
            ids = self._encode_text(buffer)
        except UnicodeEncodeError:
            raise ValueError(_unencodable_message(buffer, offset)) from None
        if ids:
            yield ids

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        self._encode_pieces(split_on_special_tokens(text, self._special_regex), ids)
        return ids

    def _encode_pieces(self, pieces: Iterable[tuple[str, bool]], ids: list[int]) -> None:
        """Append the ids of (piece, is_special) pairs, as ``split_on_special_tokens`` yields them, to ids."""
        for piece, is_special in pieces:
            if is_special:
                ids.append(self._special_ids[piece])
            else:
                self._bpe.encode(piece, ids)

    def _split_stable_prefix(self, buffer: str) -> tuple[list[int], str]:
        """Encode the part of buffer that no later text can change; return (its ids, the held-back rest).

        Held back: a tail that is a proper prefix of a special token (more text may complete it), and the end of
        the last ordinary piece from its ``_stable_boundary``; without one, with GPT-2's pipeline, the final
        pre-tokens covering its last ``_LOOKAHEAD_CHARS`` characters (an earlier match was decided by characters
        already present: ``\\s+(?!\\S)`` gives trailing spaces to the next word only once it arrives), and with
        any other pipeline the whole piece.
        """
        cut = len(buffer) - self._partial_special_length(buffer)
        head, pending = buffer[:cut], buffer[cut:]
        pieces = list(split_on_special_tokens(head, self._special_regex))
        open_piece = pieces.pop()[0] if pieces and not pieces[-1][1] else ""
        ids: list[int] = []
        self._encode_pieces(pieces, ids)
        boundary = self._stable_boundary(open_piece)
        if boundary > 0:
            self._bpe.encode(open_piece[:boundary], ids)
            return ids, open_piece[boundary:] + pending
        if not self.pipeline.splits_like_gpt2:
            return ids, open_piece + pending
        pretokens = split_pretokens(open_piece)
        held: list[str] = []
        held_chars = 0
        while pretokens and held_chars < _LOOKAHEAD_CHARS:
            held.append(pretokens.pop())
            held_chars += len(held[-1])
        self._bpe.encode_pretokens(pretokens, ids)  # not re-joined: joining could merge them into new pre-tokens
        return ids, "".join(reversed(held)) + pending

    def _stable_boundary(self, text: str) -> int:
        """A position in text where a pre-token starts whatever follows text, and nothing before it depends on
        what comes after (so is NFC: the character there is ASCII); 0 when none is known. For a named pattern: the
        last space after a non-whitespace character, else (unless the pipeline ``splits_like_gpt2``) the last line
        start between printable ASCII characters (``X"\\n"Y``); a custom pattern has none."""
        if not has_known_boundaries(self.pipeline.pattern):
            return 0
        boundary = last_space_boundary(text)
        if boundary > 0 or self.pipeline.splits_like_gpt2:
            return boundary
        return line_start_boundary(text)

    def _partial_special_length(self, buffer: str) -> int:
        """Length of the longest tail of buffer that is a proper prefix of some special token (0 if none)."""
        for length in range(min(self._max_special_prefix, len(buffer)), 0, -1):
            if buffer[-length:] in self._special_prefixes:
                return length
        return 0

    # ------------------------------------------------------------------ decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of ids (may be invalid UTF-8 when a multi-byte character is cut)."""
        ids = ids if isinstance(ids, list | tuple) else list(ids)
        vocab = self.vocab
        try:
            return b"".join([vocab[token_id] for token_id in ids])
        except (KeyError, TypeError):
            position, bad = next((i, t) for i, t in enumerate(ids) if not _is_known_id(vocab, t))
            raise ValueError(f"cannot decode id {bad!r} at position {position}: "
                             f"not in the vocabulary (ids 0..{self.vocab_size - 1})") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; malformed UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ set-up helpers
    def _ordinary_tokens(self) -> dict[bytes, int]:
        """bytes -> id of every token but the special ones: what ignore_merges looks a pre-token up in (as HF looks
        it up in the model's vocab, which holds no added token)."""
        special_ids = set(self._special_ids.values())
        return {data: token_id for data, token_id in self._bytes_to_id.items() if token_id not in special_ids}

    def _add_special_tokens(self) -> dict[str, int]:
        """Map each special token to its id, appending the ones the vocab lacks after the largest id.

        Several ids can hold a special token's bytes: a one-character special (say "|") is also a byte, and a
        vocab may have both a special entry and a merged token with the same bytes. The special id is then the
        smallest above the 256 bytes (where trainers put specials), and ordinary text maps those bytes to another
        of the ids, so that encoding plain text never yields a special id. A special whose bytes only one id
        holds (say "|" added to the GPT-2 vocab) shares that id with plain text.
        """
        repeated_bytes = len(self._bytes_to_id) < len(self.vocab)  # the inverse map keeps one id per bytes
        special_ids = {}
        for token in self.special_tokens:
            data = token.encode("utf-8")
            if data not in self._bytes_to_id:
                new_id = self.vocab_size
                self.vocab[new_id] = data
                self._bytes_to_id[data] = new_id
            holders = [i for i, value in self.vocab.items() if value == data] if repeated_bytes else []
            special = min(holders or [self._bytes_to_id[data]], key=lambda i: (i < 256, i))
            special_ids[token] = special
            plain = [i for i in holders if i != special]
            if plain and self._bytes_to_id[data] == special:
                self._bytes_to_id[data] = min(plain)
        return special_ids


def _is_known_id(vocab: dict[int, bytes], token_id: object) -> bool:
    try:
        return token_id in vocab
    except TypeError:  # unhashable
        return False


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text to encode must be a str, got {type(text).__name__} (decode bytes first)")


def _single_byte_ids(bytes_to_id: dict[bytes, int]) -> list[int]:
    missing = [value for value in range(256) if bytes([value]) not in bytes_to_id]
    if missing:
        raise ValueError(f"vocab lacks {len(missing)} of the 256 single-byte tokens, e.g. {bytes([missing[0]])!r}; "
                         "a byte-level BPE vocab needs all of them")
    return [bytes_to_id[bytes([value])] for value in range(256)]


def _unencodable_message(text: str, offset: int) -> str:
    """Name the first character that UTF-8 cannot encode (a lone surrogate) and its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"text is not encodable as UTF-8: character {text[error.start]!r} at position "
                f"{offset + error.start} is a lone surrogate")
    return "text is not encodable as UTF-8"
