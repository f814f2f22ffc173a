"""Split patterns, NFC and ignore_merges (``tokenizer/pipeline.py``), against the real libraries.

- Llama 3- and Qwen2-style tokenizer.json files built with HF ``tokenizers`` (a BPE trained by its BpeTrainer, then
  Split(Regex(pattern), "isolated") + ByteLevel(use_regex=False), NFC for Qwen2, ignore_merges for Llama 3 over a
  vocab whose tokens the merges do not all make, added tokens special and not) load with ``tokenizers``' ids, by the
  fast and the readable encoder, whole and streamed, on adversarial and hypothesis text.
- ``scratchlm tokenizer train --pattern gpt4`` trains with tiktoken's cl100k split (tiktoken's own ``pat_str`` is the
  oracle), the merges of the slow reference trainer, and exports a tokenizer.json that ``tokenizers`` and
  ``transformers.AutoTokenizer`` encode as we do; the parallel counting paths cut only where each pattern allows.
- The facts the fast paths assume of the named patterns hold; a pipeline we do not implement is refused by name.
"""

from __future__ import annotations

import gzip
import json
import unicodedata
from collections import Counter
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import require_shared
from scratchlm.cli import main
from scratchlm.data.encode import encode_corpus
from scratchlm.data.token_file import open_token_file
from scratchlm.tokenizer import Tokenizer, train_bpe
from scratchlm.tokenizer.bpe import reference_pretoken_counts, reference_train_bpe
from scratchlm.tokenizer.counting import count_pretokens
from scratchlm.tokenizer.fast.tiktoken_engine import TiktokenTokenizer
from scratchlm.tokenizer.formats.hf import UnsupportedHFTokenizer
from scratchlm.tokenizer.formats.io import FormatCannotHold
from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.tokenizer.pretokenize import (
    GPT2_SPLIT_PATTERN,
    GPT4_SPLIT_PATTERN,
    LLAMA3_SPLIT_PATTERN,
    NAMED_PATTERNS,
    QWEN2_SPLIT_PATTERN,
    pretokens,
)
from scratchlm.tokenizer.training_inputs import count_input_pretokens

hf_tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SETTINGS = settings(max_examples=120, deadline=None)
EOT = "<|endoftext|>"
# Llama 3's and Qwen2's kinds of added tokens: special ones, reserved ones, and special=False ones (Qwen's tool
# tags); "<|im" and "start|>" overlap "<|im_start|>", so the leftmost-longest rule decides between them.
SPECIAL = [EOT, "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|reserved_special_token_0|>"]
NOT_SPECIAL = ["<tool_call>", "</tool_call>", "<|im", "start|>"]
ADDED = SPECIAL + NOT_SPECIAL
ADVERSARIAL = [
    "", " ", "  ", "\n", "\r\n", "\r\n\r\n", "\n\n\n  x", "  \n\n  \t\n", " " * 300, "\t \n " * 20, "a  b   c    ",
    "1 12 123 1234 12345 123456789 3.14159 1,000,000 ١٢٣٤ ²³", "0123456789" * 30, "x1y22z333",
    "'s 've 're 'll 'd 'm 't 'S 'LL 'Ll 'ſ 'K", "I'LL DON'T WE'RE THEY'VE SHE'D I'M IT'S", "x'LLy it's' ''s 'tis",
    "Hello, world! 😀🎉👨‍👩‍👧‍👦 family 🏳️‍🌈", "日本語のテキスト、中文字符。한국어 Ελληνικά русский العربية हिन्दी",
    "e\u0301 n\u0303 a\u0308\u0301\u0327 \u0301\u0301 marks first", "Å Å Å \u1100\u1161\u11a8 한", "café vs cafe\u0301",
    "def f(x):\n    return x**2  # code\n\tif a!=b:\n\t\tpass\n", "a!\n\nb?\r\n\r\nc;\n\n\n", "!!!\n\n\n!!!",
    "x" * 1500,
    "\u00a0\u2003\u3000 nbsp", "\u2028\u2029\x85 separators", "\x00\x01\x1c\x7f\x80\x9f controls", "ﬁ ǅ ½ ²",
    EOT, EOT + EOT, f"a{EOT}b", f" {EOT} ", f"\n{EOT}\n", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant",
    "<|im_starts|> <|im_start <|imstart|> <|im|> <tool_call>{\"a\": 1}</tool_call>", "<|begin_of_text|><|im_start|>",
    "x<|reserved_special_token_0|>y <|reserved_special_token_1|>", "<|im<|im_end|>start|>", "<|endoftext|<tool_call>|>",
]
PIECES = [" ", "  ", "\n", "\r\n", "\t", "a", "A", "the", " cat", "'s", "'S", "'", "ll", "LL", "7", "42", "12345",
          "!", "?!", "😀", "👨‍👩‍👧", "日本", "\u0301", "\u0308", "e", "é", "\u1100", "\u1161", "Å",
          "\u00a0", "\x1c", "\u0085", "\u2028", "\u3000", "ſ", "K", "def", "(x)", "    ", *ADDED, "<|", "|>", "im",
          "_start"]
piece_text = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
# Characters this Python's Unicode database (14.0) calls unassigned are left out: the regex module knows newer
# Unicode versions and HF's Oniguruma older ones, and the two classify such letters differently.
any_text = st.one_of(piece_text, st.text(st.characters(blacklist_categories=("Cs", "Cn")), max_size=150))

pytestmark = pytest.mark.usefixtures("hf_offline_module")


@pytest.fixture(scope="module")
def corpus_text() -> str:
    text = "".join(require_shared(f"fixtures/{name}").read_text(encoding="utf-8")
                   for name in ("corpus.en", "german.txt", "tinystories_sample.txt", "address.txt"))
    return text + EOT + "".join(ADVERSARIAL[:-12]) * 10


def _hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------------------------ Llama 3 / Qwen2 files
def _hf_built(corpus_text: str, folder: Path, pattern: str, *, nfc: bool, ignore_merges: bool) -> Path:
    """A tokenizer.json as Llama 3's or Qwen2's is made: Split + ByteLevel, NFC or not, ignore_merges or not."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

    hf = hf_tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(corpus_text.split(EOT), trainer)
    hf.add_special_tokens(SPECIAL)
    hf.add_tokens([AddedToken(token, special=False, normalized=False) for token in NOT_SPECIAL])
    hf.save(str(folder / "tokenizer.json"))
    if ignore_merges:  # as in Llama 3: tokens in the vocab that no merge makes, which only ignore_merges emits
        document = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        document["model"]["merges"] = document["model"]["merges"][::7] + document["model"]["merges"][1::7]
        (folder / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    return folder


STYLES = {"llama3": dict(pattern=LLAMA3_SPLIT_PATTERN, nfc=False, ignore_merges=True),
          "qwen2": dict(pattern=QWEN2_SPLIT_PATTERN, nfc=True, ignore_merges=False)}


@pytest.fixture(scope="module")
def built(corpus_text, tmp_path_factory) -> dict[str, Path]:
    """The folder of each style's tokenizer.json."""
    return {name: _hf_built(corpus_text, tmp_path_factory.mktemp(name), **STYLES[name]) for name in STYLES}


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request, built) -> tuple[str, object, Tokenizer, Tokenizer]:
    """(name, the HF tokenizer, ours fast, ours readable) of one style."""
    folder = built[request.param]
    hf = hf_tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return request.param, hf, Tokenizer.load(folder), Tokenizer.load(folder, fast=False)


def test_the_files_read_as_their_pipeline_and_added_tokens(style):
    name, hf, fast, readable = style
    assert fast.pipeline == Pipeline(**STYLES[name]) == readable.pipeline
    assert fast.special_tokens == ADDED
    assert [fast.special_id(token) for token in ADDED] == [hf.token_to_id(token) for token in ADDED]
    assert fast.hash == readable.hash != Tokenizer(fast.vocab, fast.merges, fast.special_tokens).hash


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_ids_equal_hf_on_adversarial_text(style, text):
    name, hf, fast, readable = style
    ids = _hf_ids(hf, text)
    assert fast.encode(text) == ids
    assert readable.encode(text) == ids
    assert list(fast.encode_iterable(iter(text[i:i + 5] for i in range(0, len(text), 5)))) == ids
    assert fast.decode(ids) == (unicodedata.normalize("NFC", text) if STYLES[name]["nfc"] else text)


@SETTINGS
@given(text=any_text, cuts=st.lists(st.integers(0, 150), max_size=6))
def test_ids_equal_hf_on_any_text_whole_and_streamed(style, text, cuts):
    _, hf, fast, readable = style
    ids = _hf_ids(hf, text)
    assert fast.encode(text) == ids
    assert readable.encode(text) == ids
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert [i for part in fast.encode_stream(iter(chunks), chunk_chars=4) for i in part] == ids


def test_each_setting_changes_the_ids_so_the_tests_can_fail(style, corpus_text):
    """With GPT-2's pattern, without its NFC (or with it), without its ignore_merges, the same vocab gives other
    ids."""
    name, hf, fast, _ = style
    text = corpus_text[:20_000] + "".join(ADVERSARIAL)
    ids = _hf_ids(hf, text)
    changes = [{"pattern": GPT2_SPLIT_PATTERN}, {"nfc": not fast.pipeline.nfc}]
    if fast.pipeline.ignore_merges:
        changes.append({"ignore_merges": False})
    for change in changes:
        other = Tokenizer(fast.vocab, fast.merges, fast.special_tokens, pipeline=Pipeline(**{**STYLES[name], **change}))
        assert other.encode(text) != ids, change


def test_ours_saved_reads_back_and_hf_reads_it_as_the_original(style, tmp_path):
    _, hf, fast, _ = style
    folder = fast.save(tmp_path / "saved")
    assert not (folder / "vocab.json").exists()  # GPT-2's files cannot name another pattern
    assert json.loads((folder / "scratchlm-tokenizer.json").read_text())["format_version"] == 3
    again = Tokenizer.load(folder)
    assert (again.hash, again.pipeline) == (fast.hash, fast.pipeline)
    (folder / "scratchlm-tokenizer.json").unlink()
    assert Tokenizer.load(folder).hash == fast.hash  # from the tokenizer.json we wrote
    resaved = hf_tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ADVERSARIAL:
        assert _hf_ids(resaved, text) == _hf_ids(hf, text)


def test_the_tiktoken_engine_refuses_tokens_that_only_ignore_merges_emits(built):
    with pytest.raises(ValueError, match="the tiktoken engine cannot give this tokenizer's ids"):
        TiktokenTokenizer.like(Tokenizer.load(built["llama3"]))


# ------------------------------------------------------------------------------------ the named patterns
@pytest.fixture(scope="module")
def tiktoken_cl100k_pattern() -> str:
    """tiktoken's own cl100k_base pat_str, without downloading its ranks."""
    from tiktoken_ext import openai_public

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
        return openai_public.cl100k_base()["pat_str"]


def test_gpt4_is_cl100k_spelled_for_every_regex_engine(tiktoken_cl100k_pattern):
    assert NAMED_PATTERNS["gpt4"] == GPT4_SPLIT_PATTERN != LLAMA3_SPLIT_PATTERN == NAMED_PATTERNS["llama3"]
    assert "{1,3}+" in tiktoken_cl100k_pattern  # tiktoken's possessive spelling, which Oniguruma misreads
    assert r"\s++$" in tiktoken_cl100k_pattern  # Oniguruma's $ is the end of any line
    assert LLAMA3_SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}") == QWEN2_SPLIT_PATTERN


@pytest.mark.parametrize(("text", "gpt4", "llama3"), [
    ("\n ", ["\n "], ["\n", " "]),  # found by hypothesis: whitespace that ends the text is one pre-token in cl100k
    ("a\n ", ["a", "\n "], ["a", "\n", " "]),
    ("hi \r\n  ", ["hi", " \r\n  "], ["hi", " \r\n", "  "]),
    ("a  \nb", ["a", "  \n", "b"], ["a", "  \n", "b"]),  # not at the end (nor at a line's end): the same split
    ("end.\n  ", ["end", ".\n", "  "], ["end", ".\n", "  "]),
])
def test_gpt4_and_llama3_differ_only_at_the_end_of_the_text(tiktoken_cl100k_pattern, text, gpt4, llama3):
    from tokenizers import Regex, pre_tokenizers

    assert pretokens(text, tiktoken_cl100k_pattern) == pretokens(text, GPT4_SPLIT_PATTERN) == gpt4
    assert pretokens(text, LLAMA3_SPLIT_PATTERN) == llama3
    for pattern, expected in ((GPT4_SPLIT_PATTERN, gpt4), (LLAMA3_SPLIT_PATTERN, llama3)):
        assert [piece for piece, _ in pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)] \
            == expected


@SETTINGS
@given(any_text)
def test_the_named_patterns_split_as_hf_and_tiktoken_do(tiktoken_cl100k_pattern, text):
    from tokenizers import Regex, pre_tokenizers

    for pattern in NAMED_PATTERNS.values():
        split = pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)
        assert pretokens(text, pattern) == [piece for piece, _ in split]
    assert pretokens(text, GPT4_SPLIT_PATTERN) == pretokens(text, tiktoken_cl100k_pattern)


@SETTINGS
@given(st.lists(st.sampled_from(PIECES[:-len(ADDED) - 4] + ["x", "!", "~"]), max_size=30).map("".join),
       st.sampled_from(["!", "a", "7", "~"]), st.lists(st.sampled_from(PIECES[:-len(ADDED) - 4]), max_size=30).map(
           "".join), st.sampled_from(["a", "!", "~", "7"]))
def test_the_boundaries_the_fast_paths_cut_at(left, before, right, after):
    """A space after a non-space, and a line start between printable ASCII, start a pre-token of every named
    pattern, and the pre-tokens before them do not depend on what follows."""
    for pattern in NAMED_PATTERNS.values():
        head = left + before
        assert pretokens(head + " " + right, pattern) == pretokens(head, pattern) + pretokens(" " + right, pattern)
        tail = after + right
        assert pretokens(head + "\n" + tail, pattern) == pretokens(head + "\n", pattern) + pretokens(tail, pattern)


def test_a_custom_pattern_keeps_the_text_between_matches_as_hf_does():
    from tokenizers import Regex, pre_tokenizers

    pattern = r"\p{L}+|\d"  # matches neither spaces nor punctuation
    text = "Hello, world 42!! ok"
    split = pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)
    assert pretokens(text, pattern) == [piece for piece, _ in split] == ["Hello", ", ", "world", " ", "4", "2",
                                                                         "!! ", "ok"]


@pytest.mark.parametrize("pattern, message", [("(", "is not a valid regex"), ("a*", "matches the empty text"),
                                              (3, "must be a string")])
def test_a_bad_pattern_is_one_clear_line(pattern, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(pattern)


# ------------------------------------------------------------------------------------ training with a pattern
TRAINING_PATTERNS = {"gpt4": GPT4_SPLIT_PATTERN, "qwen2": QWEN2_SPLIT_PATTERN, "custom": r"[a-z]+|\s|[0-9]{2}"}


@pytest.fixture(scope="module")
def training_file(corpus_text, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train") / "corpus.txt"
    # "!\n" is one cl100k pre-token: GPT-2's chunk cut (before a "\n" after ASCII) would split it.
    path.write_text((corpus_text[:30_000] + "!\nx?\n\n\ny") * 2, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(TRAINING_PATTERNS))
def test_training_with_a_pattern_gives_the_reference_merges(training_file, name):
    pattern = TRAINING_PATTERNS[name]
    expected = reference_train_bpe(training_file, 400, [EOT], pattern)
    assert train_bpe(training_file, 400, [EOT], num_workers=1, pattern=pattern) == expected
    assert expected != reference_train_bpe(training_file, 400, [EOT])  # the pattern matters


@pytest.mark.parametrize("name", sorted(TRAINING_PATTERNS))
def test_parallel_chunked_counting_cuts_only_where_the_pattern_allows(training_file, tmp_path, name):
    pattern = TRAINING_PATTERNS[name]
    text = training_file.read_text(encoding="utf-8")
    expected = reference_pretoken_counts(text, [EOT], pattern)
    counts = count_pretokens([training_file], [EOT], num_workers=2, chunk_bytes=2048, parallel_threshold=0,
                             pattern=pattern)
    assert counts == expected
    packed = tmp_path / "corpus.txt.gz"  # the streamed path cuts a compressed text into parts
    packed.write_bytes(gzip.compress(training_file.read_bytes()))
    assert count_input_pretokens([packed], [EOT], num_workers=1, pattern=pattern) == expected


def test_gpt2s_chunk_cut_would_be_wrong_for_gpt4(training_file):
    """Why the cut moved: counted at GPT-2's positions, cl100k's "!\\n" pre-tokens come out split."""
    text = training_file.read_text(encoding="utf-8")
    cut = text.index("!\n") + 1
    halves = Counter()
    for half in (text[:cut], text[cut:]):
        halves.update(reference_pretoken_counts(half, [EOT], GPT4_SPLIT_PATTERN))
    assert halves != reference_pretoken_counts(text, [EOT], GPT4_SPLIT_PATTERN)


@pytest.fixture(scope="module")
def gpt4_trained(training_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt4") / "tok"
    assert main(["tokenizer", "train", "--input", str(training_file), "--vocab-size", "600", "--special-token", EOT,
                 "--pattern", "gpt4", "--out", str(out), "--quiet"]) == 0
    return out


def test_train_pattern_gpt4_saves_the_pattern(gpt4_trained, training_file):
    ours = Tokenizer.load(gpt4_trained)
    assert ours.pipeline == Pipeline(GPT4_SPLIT_PATTERN)
    vocab, merges = train_bpe(training_file, 600, [EOT], num_workers=1, pattern=GPT4_SPLIT_PATTERN)
    assert (ours.vocab, ours.merges) == (vocab, merges)
    assert ours.hash != Tokenizer(vocab, merges, [EOT]).hash  # the pattern is part of its identity


@pytest.fixture(scope="module")
def gpt4_libraries(gpt4_trained) -> tuple[Tokenizer, object, object]:
    return (Tokenizer.load(gpt4_trained), hf_tokenizers.Tokenizer.from_file(str(gpt4_trained / "tokenizer.json")),
            transformers.AutoTokenizer.from_pretrained(gpt4_trained, local_files_only=True))


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_the_gpt4_export_encodes_as_we_do_in_tokenizers_and_transformers(gpt4_libraries, text):
    ours, hf, auto = gpt4_libraries
    ids = ours.encode(text)
    assert _hf_ids(hf, text) == ids
    assert auto.encode(text, add_special_tokens=False) == ids
    assert auto.decode(ids) == text == ours.decode(ids)


@SETTINGS
@given(any_text)
def test_the_gpt4_export_encodes_as_we_do_on_any_text(gpt4_libraries, tiktoken_cl100k_pattern, text):
    ours, hf, auto = gpt4_libraries
    ids = ours.encode(text)
    assert _hf_ids(hf, text) == ids == auto.encode(text, add_special_tokens=False)
    assert ours.encode_ordinary(text) == _cl100k_of(ours, tiktoken_cl100k_pattern).encode_ordinary(text)


@pytest.fixture(scope="module", params=["gpt4", "qwen2+nfc"])
def tiktoken_pair(request, gpt4_libraries) -> tuple[Tokenizer, TiktokenTokenizer]:
    """(our readable encoder, its tiktoken twin) with the gpt4 tokenizer's vocab, under its pattern or Qwen2's
    pattern and NFC."""
    ours = gpt4_libraries[0]
    pipeline = Pipeline(GPT4_SPLIT_PATTERN) if request.param == "gpt4" else Pipeline(QWEN2_SPLIT_PATTERN, nfc=True)
    readable = Tokenizer(ours.vocab, ours.merges, ours.special_tokens, pipeline=pipeline, fast=False)
    return readable, TiktokenTokenizer.like(readable)


@SETTINGS
@given(st.one_of(any_text, st.sampled_from(ADVERSARIAL)))
def test_the_tiktoken_engine_takes_the_pattern_and_nfc(tiktoken_pair, text):
    readable, engine = tiktoken_pair
    assert engine.encode(text) == readable.encode(text)
    assert list(engine.encode_iterable(iter(text[i:i + 7] for i in range(0, len(text), 7)))) == readable.encode(text)


def _cl100k_of(ours: Tokenizer, pat_str: str) -> tiktoken.Encoding:
    """tiktoken with our ranks and its own cl100k pat_str (an oracle for the split, in tiktoken's regex engine)."""
    from scratchlm.tokenizer.fast.tiktoken_engine import mergeable_ranks

    return tiktoken.Encoding("cl100k-pattern", pat_str=pat_str, mergeable_ranks=mergeable_ranks(ours),
                             special_tokens={})


def test_the_cli_refuses_a_bad_pattern_in_one_line(training_file, tmp_path, capsys):
    assert main(["tokenizer", "train", "--input", str(training_file), "--vocab-size", "300", "--pattern", "([a-z]",
                 "--out", str(tmp_path / "tok"), "--quiet"]) != 0
    error = capsys.readouterr().err.strip()
    assert "--pattern: split pattern '([a-z]' is not a valid regex" in error and "\n" not in error
    assert not (tmp_path / "tok").exists()


def test_a_possessive_interval_gets_no_hf_file(training_file, tmp_path):
    pattern = r"\p{L}++|\p{N}{1,3}+|\s|[^\s\p{L}\p{N}]"
    vocab, merges = train_bpe(training_file, 300, [], num_workers=1, pattern=pattern)
    with pytest.warns(UserWarning, match=r"reads the possessive '\{m,n\}\+'"):
        Tokenizer(vocab, merges, pipeline=Pipeline(pattern)).save(tmp_path / "tok")
    assert not (tmp_path / "tok" / "tokenizer.json").exists()
    with pytest.raises(FormatCannotHold):
        from scratchlm.tokenizer.formats.hf import hf_tokenizer_document

        hf_tokenizer_document(Tokenizer(vocab, merges, pipeline=Pipeline(pattern)))


# ------------------------------------------------------------------------------------ encode paths that cut text
def test_data_encode_in_parallel_ranges_equals_encoding_the_whole(tmp_path):
    text = "a!\n\nb?\n\n\nc\nd" * 40_000
    source = tmp_path / "text.txt"
    source.write_text(text, encoding="utf-8")
    ours = Tokenizer(*train_bpe(source, 300, [], num_workers=1, pattern=GPT4_SPLIT_PATTERN),
                     pipeline=Pipeline(GPT4_SPLIT_PATTERN))
    # GPT-2's cut between the two "\n" of a paragraph break would split cl100k's "!\n\n":
    assert ours.encode("a!\n") + ours.encode("\nb") != ours.encode("a!\n\nb")
    stats = encode_corpus(ours, [source], tmp_path / "out.tok", workers=2, end_of_text=False)
    assert stats.workers == 2
    assert open_token_file(tmp_path / "out.tok").tokens.tolist() == ours.encode(text)


def test_a_custom_pattern_is_never_cut_inside_a_piece(gpt4_libraries, tmp_path):
    """Its safe cuts are unknown: a stream is held back to the end (or a special token), a file is one range."""
    from scratchlm.data.encode import _plan_ranges

    ours = gpt4_libraries[0]
    custom = Tokenizer(ours.vocab, ours.merges, ours.special_tokens, pipeline=Pipeline(r"\S\n\S|\s|\S"))
    text = "ab cd\nef gh\n" * 100
    ids, rest = custom._split_stable_prefix(text)
    assert (ids, rest) == ([], text)
    assert ours._split_stable_prefix(text)[1] == " gh\n"
    source = tmp_path / "text.txt"
    source.write_text(text * 3000, encoding="utf-8")
    assert len(_plan_ranges([source], custom, 2)) == 1 < len(_plan_ranges([source], ours, 2))


# ------------------------------------------------------------------------------------ identity and files
def test_gpt2s_pipeline_adds_nothing_and_every_other_setting_a_line():
    assert GPT2_PIPELINE.identity_lines() == []
    lines = [Pipeline(GPT4_SPLIT_PATTERN).identity_lines(), Pipeline(nfc=True).identity_lines(),
             Pipeline(ignore_merges=True).identity_lines()]
    assert all(len(setting) == 1 for setting in lines) and len({line for setting in lines for line in setting}) == 3


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(normalizer="NFKC"), "normalizer 'NFKC' is not null or \"NFC\""),
    (lambda d: d.update(pattern="("), "is not a valid regex"),
    (lambda d: d.pop("ignore_merges"), "key 'ignore_merges' is missing"),
    (lambda d: d.update(format_version=4), "unsupported tokenizer format_version 4"),
])
def test_a_bad_version_3_file_is_one_clear_line(style, tmp_path, edit, message):
    _, _, fast, _ = style
    folder = fast.save(tmp_path / "tok")
    document = json.loads((folder / "scratchlm-tokenizer.json").read_text(encoding="utf-8"))
    edit(document)
    (folder / "scratchlm-tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ValueError, match=message) as refused:
        Tokenizer.load(folder)
    assert str(refused.value).startswith(str(folder)) and "\n" not in str(refused.value)


def _split(**changes) -> dict:
    return {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False,
            **changes}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _pre_tokenizer(*members) -> callable:
    return lambda d: d.update(pre_tokenizer={"type": "Sequence", "pretokenizers": list(members)})


REFUSED = {
    "split_removed": (_pre_tokenizer(_split(behavior="Removed"), _BYTE_LEVEL), "sets behavior 'Removed'"),
    "split_inverted": (_pre_tokenizer(_split(invert=True), _BYTE_LEVEL), "sets invert True"),
    "split_string": (_pre_tokenizer(_split(pattern={"String": " "}), _BYTE_LEVEL), "pattern is {'String': ' '}"),
    "split_bad_regex": (_pre_tokenizer(_split(pattern={"Regex": "(?<x"}), _BYTE_LEVEL), "is not a valid regex"),
    "whitespace_first": (_pre_tokenizer({"type": "Whitespace"}, _BYTE_LEVEL),
                         "pre-tokenizer Sequence of ['Whitespace', 'ByteLevel']"),
    "byte_level_regex_after_split": (_pre_tokenizer(_split(), {**_BYTE_LEVEL, "use_regex": True}),
                                     "sets use_regex True"),
    "byte_level_prefix_space": (_pre_tokenizer(_split(), {**_BYTE_LEVEL, "add_prefix_space": True}),
                                "sets add_prefix_space True"),
    "metaspace": (lambda d: d.update(pre_tokenizer={"type": "Metaspace"}), "pre-tokenizer 'Metaspace'"),
    "no_pre_tokenizer": (lambda d: d.update(pre_tokenizer=None), "pre-tokenizer None"),
    "nfkc": (lambda d: d.update(normalizer={"type": "NFKC"}), "normalizer 'NFKC'"),
    "nfc_then_lowercase": (lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Lowercase"}]}), "normalizer Sequence of ['NFC', 'Lowercase']"),
    "byte_fallback": (lambda d: d["model"].update(byte_fallback=True), "sets byte_fallback True"),
    "dropout": (lambda d: d["model"].update(dropout=0.1), "sets dropout 0.1"),
    "word_suffix": (lambda d: d["model"].update(end_of_word_suffix="</w>"), "sets end_of_word_suffix '</w>'"),
    "wordpiece": (lambda d: d["model"].update(type="WordPiece"), "model 'WordPiece'"),
    "unigram": (lambda d: d["model"].update(type="Unigram"), "model 'Unigram'"),
    "normalized_added_with_nfc": (lambda d: d.update(normalizer={"type": "NFC"}) or d["added_tokens"][0].update(
        normalized=True), "sets normalized true with the NFC normalizer"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unsupported_pipeline_is_refused_by_name_in_one_line(built, tmp_path, case):
    edit, message = REFUSED[case]
    document = json.loads((built["llama3"] / "tokenizer.json").read_text(encoding="utf-8"))
    edit(document)
    (tmp_path / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(UnsupportedHFTokenizer) as refused:
        Tokenizer.load(tmp_path)
    text = str(refused.value)
    assert text.startswith(str(tmp_path)) and "\n" not in text
    assert message in text, text
