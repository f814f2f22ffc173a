"""Hugging Face's tokenizer.json, both ways, against the real libraries.

Ours saved -> HF `tokenizers` and `transformers.AutoTokenizer` give our ids and our text back; HF-made
tokenizer.json files (trained by `tokenizers`, or built from GPT-2's files) -> `Tokenizer.load` gives HF's ids;
old folders (scratchlm's format named tokenizer.json) keep loading with the same hash; a tokenizer.json we cannot
match id for id is one clear line naming the file and the setting.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gpt2_file_paths, require_shared
from scratchlm.cli import main
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.hf import UnsupportedHFTokenizer, is_hf_document, write_hf_tokenizer
from scratchlm.tokenizer.formats.io import FormatCannotHold
from scratchlm.tokenizer.train_bpe import train_bpe

hf_tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

EOT = "<|endoftext|>"
# Specials beyond GPT-2's: one with spaces and one outside ASCII have no GPT-2 spelling of their own text.
SPECIALS = [EOT, "<|pad|>", "<|fin du texte|>", "<|é|>"]
SETTINGS = settings(max_examples=150, deadline=None)
MULTILINGUAL = ("naïve café – “quotes” 🐱🐶 日本語のテキスト 中文字符 한국어 Ελληνικά русский العربية हिन्दी "
                "e\u0301 n\u0303 👨‍👩‍👧‍👦 🏳️‍🌈 ﬁ ǅ ½ ²   \t\t  tabs\r\nand 123456 numbers'll've\n")

ADVERSARIAL = [
    "", " ", "  ", "\n", "\r\n", "\t \n ", " " * 50, "\n\n\n  x", "a  b   c    ", "trailing   ",
    "Hello, world! 😀🎉👨‍👩‍👧‍👦 family", "日本語のテキスト、中文字符。한국어", "e\u0301 n\u0303 a\u0308\u0301\u0327",
    "\u0301\u0301 combining marks first", "'s 've 're 'll 'd 'm 't 'S 'LL", "I'll DON'TCARE x'LLy it's' ''s",
    EOT, EOT + EOT, f"a{EOT}b", f" {EOT} ", f"\n{EOT}\n", f"<|endoftext|{EOT}|>", "<|endoftext", "<|endoftext|",
    "|>", f"<|pad|>x{EOT}<|fin du texte|> <|é|>é", "<|fin du", "Ġhello Ċ ĠĠ ċ Ā ł Ń",  # GPT-2's alphabet as text
    "Ã© Ã¨ mojibake Ã", "\ufffd replacement \ufffd\ufffd", "\x00\x01\x1c\x7f\x80\x9f\xa0\xad\xff controls",
    "\\xff\\x00 escapes", "\ufeff BOM", "\u200b\u200c\u200d zero width", "\u00a0\u2003\u3000 nbsp",
    "\u2028\u2029\x85 separators", "\U0010ffff \ue000 \uffff \U000e0001", "🏳️‍🌈" * 5, "x" * 3000,
    "0123456789" * 30, "abcαβγ123١٢٣ mixed", MULTILINGUAL,
]
PIECES = [" ", "  ", "\n", "\r\n", "\t", "a", "the", " cat", "'s", "'", "ll", "7", "42", "!", "?!", "😀", "👨‍👩‍👧",
          "日本", "\u0301", "é", EOT, "<|", "endoftext", "|>", "<|pad|>", "<|é|>", "\u00a0", "\x1c", "\u0085",
          "\u2028", "\u3000", "Ġ", "\ufffd"]
piece_text = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
any_text = st.one_of(piece_text, st.text(max_size=200))

pytestmark = pytest.mark.usefixtures("hf_offline_module")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    text = "".join(require_shared(f"fixtures/{name}").read_text(encoding="utf-8")
                   for name in ("corpus.en", "german.txt", "tinystories_sample.txt"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(f"{text}{EOT}{MULTILINGUAL * 20}", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def ours(corpus) -> Tokenizer:
    vocab, merges = train_bpe(corpus, 1000, SPECIALS, num_workers=1)
    return Tokenizer(vocab, merges, SPECIALS)


@pytest.fixture(scope="module")
def saved(ours, tmp_path_factory) -> Path:
    return ours.save(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def hf_of_ours(saved):
    return hf_tokenizers.Tokenizer.from_file(str(saved / "tokenizer.json"))


@pytest.fixture(scope="module")
def auto_of_ours(saved):
    return transformers.AutoTokenizer.from_pretrained(saved, local_files_only=True)


def _hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------------------------ ours -> Hugging Face
def test_save_writes_every_format(saved):
    assert sorted(p.name for p in saved.iterdir()) == ["merges.txt", "scratchlm-tokenizer.json", "tokenizer.json",
                                                       "tokenizer_config.json", "vocab.json"]
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOT and config["clean_up_tokenization_spaces"] is False


# HF's ByteLevel decoder also decodes added tokens, and reads one made only of characters of GPT-2's alphabet as
# that alphabet: "é" is the alphabet's spelling of the byte 0xE9, so "<|é|>" comes back as "<|\ufffd|>". The ids
# are equal; only HF's text of such a special token differs (docs/tokenizer-encoding.md says so).
HF_TEXT_OF_SPECIAL = {"<|é|>": "<|\ufffd|>"}


def _check_hf_equals_ours(ours, hf, auto, text: str) -> None:
    ids = ours.encode(text)
    assert _hf_ids(hf, text) == ids, text
    assert auto(text, add_special_tokens=False)["input_ids"] == ids, text
    assert auto.encode(text) == ids, text  # no BOS or EOS added
    assert ours.decode(ids) == text
    hf_text = text
    for special, hf_spelling in HF_TEXT_OF_SPECIAL.items():
        hf_text = hf_text.replace(special, hf_spelling)
    assert hf.decode(ids, skip_special_tokens=False) == auto.decode(ids) == hf_text, text


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_hf_gives_our_ids_and_text_on_adversarial_text(ours, hf_of_ours, auto_of_ours, text):
    _check_hf_equals_ours(ours, hf_of_ours, auto_of_ours, text)


@SETTINGS
@given(any_text)
def test_hf_gives_our_ids_and_text_on_any_text(ours, hf_of_ours, auto_of_ours, text):
    _check_hf_equals_ours(ours, hf_of_ours, auto_of_ours, text)


@SETTINGS
@given(st.lists(st.integers(0, 255 + 4 + 200), max_size=30))
def test_hf_decodes_any_ids_as_we_do(ours, hf_of_ours, ids):
    """Byte-level tokens cut characters apart: both decoders put U+FFFD where the bytes are not UTF-8."""
    special_ids = {ours.special_id(token) for token in SPECIALS}
    plain = [token_id for token_id in ids if token_id not in special_ids]
    assert hf_of_ours.decode(plain, skip_special_tokens=False) == ours.decode(plain)


def test_special_tokens_are_special_in_transformers(ours, auto_of_ours):
    assert auto_of_ours.eos_token == EOT and auto_of_ours.eos_token_id == ours.special_id(EOT)
    ids = ours.encode(f"a cat{EOT}<|pad|>")
    assert auto_of_ours.decode(ids, skip_special_tokens=True) == "a cat"
    assert auto_of_ours.convert_ids_to_tokens(ours.special_id("<|é|>")) == "<|é|>"


def test_hf_files_alone_load_as_the_same_tokenizer(ours, saved, tmp_path):
    folder = tmp_path / "hf-only"
    folder.mkdir()
    shutil.copy(saved / "tokenizer.json", folder)
    loaded = Tokenizer.load(folder)
    assert (loaded.vocab, loaded.merges, loaded.special_tokens) == (ours.vocab, ours.merges, ours.special_tokens)
    assert loaded.hash == ours.hash


def test_special_tokens_keep_their_order_through_the_hf_file(tmp_path):
    """The hash covers the special tokens' order: HF's file lists them in ours, not in the order of their ids."""
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"<|a|>"}
    tokenizer = Tokenizer(vocab, [], ["<|b|>", "<|a|>"])  # <|b|> is appended after <|a|>, as id 257
    tokenizer.save(tmp_path)
    assert _hf_ids(hf_tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")), "<|a|><|b|>") == [256, 257]
    (tmp_path / "scratchlm-tokenizer.json").unlink()
    loaded = Tokenizer.load(tmp_path)
    assert loaded.special_tokens == ["<|b|>", "<|a|>"] and loaded.hash == tokenizer.hash


def test_a_tokenizer_hf_cannot_hold_gets_no_hf_file(tmp_path):
    """A special spelled like another token's GPT-2 string would share its entry in HF's vocab; a special that is
    also an ordinary token made by a merge would be looked up by its GPT-2 spelling: both refused."""
    vocab = {i: bytes([i]) for i in range(256)} | {256: b" x"}
    also_merged = Tokenizer(vocab, [(b" ", b"x")], [" x"])  # the special is id 256, which " " + "x" makes
    with pytest.raises(FormatCannotHold, match="special token ' x': merge #0 uses or makes its bytes"):
        write_hf_tokenizer(tmp_path, also_merged)
    tokenizer = Tokenizer(vocab, [(b" ", b"x")], ["\u0120x"])  # "Ġx": how HF spells the bytes " x"
    with pytest.raises(FormatCannotHold, match="ids 256 and 257: both are spelled 'Ġx'"):
        write_hf_tokenizer(tmp_path, tokenizer)
    assert not list(tmp_path.iterdir())
    with pytest.warns(UserWarning, match="no tokenizer.json \\+ tokenizer_config.json written"):
        tokenizer.save(tmp_path / "tok")
    assert Tokenizer.load(tmp_path / "tok").special_id("\u0120x") == 257


# ------------------------------------------------------------------------------------ Hugging Face -> ours
@pytest.fixture(scope="module")
def hf_trained(corpus, tmp_path_factory) -> tuple[object, Path]:
    """A byte-level BPE trained by `tokenizers`, with tokens added after training: a special one (its id comes after
    the vocab) and a plain one with a space, matched on the text as HF matches normalized added tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

    hf = hf_tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(corpus.read_text(encoding="utf-8").split(EOT), trainer)
    hf.add_special_tokens(["<|im_start|>"])
    hf.add_tokens([AddedToken("big dog", normalized=True)])
    folder = tmp_path_factory.mktemp("hf-trained")
    hf.save(str(folder / "tokenizer.json"))
    return hf, folder


@pytest.fixture(scope="module")
def ours_of_hf_trained(hf_trained) -> Tokenizer:
    return Tokenizer.load(hf_trained[1])


def test_hf_added_tokens_become_our_special_tokens(hf_trained, ours_of_hf_trained):
    hf, _ = hf_trained
    assert ours_of_hf_trained.special_tokens == [EOT, "<|im_start|>", "big dog"]
    assert [ours_of_hf_trained.special_id(token) for token in ours_of_hf_trained.special_tokens] == [
        hf.token_to_id(token) for token in ours_of_hf_trained.special_tokens]


@pytest.mark.parametrize("text", [*ADVERSARIAL, "the big dog<|im_start|>a big  dog"], ids=range(len(ADVERSARIAL) + 1))
def test_hf_trained_tokenizer_loads_with_hf_ids(hf_trained, ours_of_hf_trained, text):
    ids = ours_of_hf_trained.encode(text)
    assert ids == _hf_ids(hf_trained[0], text)
    assert ours_of_hf_trained.decode(ids) == text


@SETTINGS
@given(any_text)
def test_hf_trained_tokenizer_gives_hf_ids_on_any_text(hf_trained, ours_of_hf_trained, text):
    assert ours_of_hf_trained.encode(text) == _hf_ids(hf_trained[0], text)


def test_hf_added_tokens_keep_their_flags_through_load_and_save(hf_trained, ours_of_hf_trained, tmp_path):
    """A plain added token ("big dog": special false, normalized true) is written back plain, not as a special one:
    HF's decode(skip_special_tokens=True) keeps it and transformers does not list it among the special tokens. The
    flags live in scratchlm's own file too, so a second load and save (which reads that file) keeps them."""
    hf, folder = hf_trained
    original = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    once = ours_of_hf_trained.save(tmp_path / "once")
    twice = Tokenizer.load(once).save(tmp_path / "twice")
    text = f"the big dog{EOT}a big  dog<|im_start|>big dog"
    for saved in (once, twice):
        assert json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"] == original
        resaved = hf_tokenizers.Tokenizer.from_file(str(saved / "tokenizer.json"))
        ids = _hf_ids(hf, text)
        assert _hf_ids(resaved, text) == ids
        assert resaved.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(saved / "tokenizer.json"))
        assert fast.all_special_tokens == [] and "big dog" in fast.decode(ids, skip_special_tokens=True)
    assert Tokenizer.load(twice).hash == ours_of_hf_trained.hash


@pytest.fixture(scope="module")
def gpt2_hf(gpt2_paths):
    """HF's GPT-2 built from GPT-2's own files (the oracle), as `tokenizers` documents it."""
    from tokenizers import decoders, models, pre_tokenizers

    hf = hf_tokenizers.Tokenizer(models.BPE.from_file(*map(str, gpt2_paths)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])
    return hf


@pytest.fixture(scope="module")
def gpt2_paths() -> tuple[Path, Path]:
    return gpt2_file_paths()


def test_gpt2_files_load_with_hf_ids_and_save_an_equal_hf_file(gpt2_hf, gpt2_paths, tmp_path):
    ours = Tokenizer.from_files(*gpt2_paths, [EOT])
    gpt2_only = tmp_path / "gpt2"
    gpt2_only.mkdir()
    shutil.copy(gpt2_paths[0], gpt2_only / "vocab.json")
    shutil.copy(gpt2_paths[1], gpt2_only / "merges.txt")
    from_folder = Tokenizer.load(gpt2_only)  # the GPT-2 pair alone: no special-token list
    assert (from_folder.vocab, from_folder.merges) == (ours.vocab, ours.merges)
    saved_hf = hf_tokenizers.Tokenizer.from_file(str(ours.save(tmp_path / "saved") / "tokenizer.json"))
    fixture_text = "".join(require_shared(f"fixtures/{name}").read_text(encoding="utf-8")[:20_000]
                           for name in ("tinystories_sample.txt", "address.txt", "german.txt", "corpus.en"))
    for text in [*ADVERSARIAL, fixture_text]:
        ids = _hf_ids(gpt2_hf, text)
        assert ours.encode(text) == ids, text
        assert _hf_ids(saved_hf, text) == ids, text
    assert Tokenizer.load(tmp_path / "saved").hash == ours.hash


# ------------------------------------------------------------------------------------ old folders
def test_old_folder_with_our_format_named_tokenizer_json_still_loads(ours, saved, tmp_path):
    """Folders saved before the Hugging Face file took the name: scratchlm's format in tokenizer.json."""
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(saved / "scratchlm-tokenizer.json", old / "tokenizer.json")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(saved / name, old)
    loaded = Tokenizer.load(old)
    assert loaded.hash == ours.hash and loaded.special_tokens == SPECIALS
    loaded.save(old)  # re-saved: our format under its own name, Hugging Face's in tokenizer.json
    assert is_hf_document(json.loads((old / "tokenizer.json").read_text(encoding="utf-8")))
    assert Tokenizer.load(old).hash == ours.hash


def test_a_recorded_hash_keeps_its_meaning(gpt2_paths):
    """The GPT-2 tokenizer's hash as runs recorded it before the new file names (computed by that code)."""
    assert Tokenizer.from_files(*gpt2_paths, [EOT]).hash == GPT2_EOT_HASH


GPT2_EOT_HASH = "b8162f428379cc7cd9dac85f6e270fa1c138d8d577ee5f28a75c49e9bbd18358"


# ------------------------------------------------------------------------------------ refused files
def _edited(document: dict, edit) -> dict:
    document = json.loads(json.dumps(document))
    edit(document)
    return document


BAD_FILES = {
    "not_a_tokenizer": (lambda d: d.clear() or d.update(foo=1), ValueError,
                        "expected a scratchlm tokenizer (a JSON object with format_version) or a Hugging Face"),
    "wordpiece": (lambda d: d["model"].update(type="WordPiece"), UnsupportedHFTokenizer, "model 'WordPiece'"),
    "metaspace": (lambda d: d.update(pre_tokenizer={"type": "Metaspace"}), UnsupportedHFTokenizer,
                  "pre-tokenizer 'Metaspace'"),
    "prefix_space": (lambda d: d["pre_tokenizer"].update(add_prefix_space=True), UnsupportedHFTokenizer,
                     "sets add_prefix_space"),
    "no_regex": (lambda d: d["pre_tokenizer"].update(use_regex=False), UnsupportedHFTokenizer, "sets use_regex"),
    "normalizer": (lambda d: d.update(normalizer={"type": "NFKC"}), UnsupportedHFTokenizer, "normalizer 'NFKC'"),
    "byte_fallback": (lambda d: d["model"].update(byte_fallback=True), UnsupportedHFTokenizer,
                      "sets byte_fallback True"),
    "lstrip": (lambda d: d["added_tokens"][0].update(lstrip=True), UnsupportedHFTokenizer, "sets lstrip"),
    "overlapping_added": (lambda d: d["added_tokens"].append(
        {"id": max(d["model"]["vocab"].values()) + 1, "content": "|>x", "normalized": True}),
        UnsupportedHFTokenizer, "can overlap"),
    "added_id_wrong": (lambda d: d["added_tokens"][0].update(id=3), ValueError,
                       "added token '<|endoftext|>' has id 3, but Hugging Face gives it"),
    "no_vocab": (lambda d: d["model"].pop("vocab"), ValueError, "model.vocab is missing"),
    "prefix_missing": (lambda d: d["pre_tokenizer"].pop("add_prefix_space"), ValueError,
                       "not a readable tokenizer.json (the ByteLevel pre-tokenizer has no add_prefix_space"),
    "space_in_vocab": (lambda d: d["model"]["vocab"].update({"a b": 99999}), ValueError,
                       "vocab token: character ' ' in 'a b' is not in GPT-2's byte table"),
    "three_part_merge": (lambda d: d["model"]["merges"].insert(0, "a b c"), ValueError,
                         "merge #0 'a b c' is not two tokens"),
    "merge_out_of_vocab": (lambda d: d["model"]["merges"].insert(0, "Ā ā"), ValueError,
                           "merge #0 (b'\\x00', b'\\x01') uses or makes"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_tokenizer_json_we_cannot_match_is_one_clear_line(saved, tmp_path, case):
    edit, error_type, message = BAD_FILES[case]
    document = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer.json").write_text(json.dumps(_edited(document, edit)), encoding="utf-8")
    with pytest.raises(error_type) as refused:
        Tokenizer.load(tmp_path)
    text = str(refused.value)
    assert text.startswith(str(tmp_path)) and "\n" not in text
    assert message in text, text


def test_the_cli_refuses_a_bad_tokenizer_json_in_one_line(saved, tmp_path, capsys):
    document = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(
        json.dumps(_edited(document, lambda d: d["model"].update(type="Unigram"))), encoding="utf-8")
    (tmp_path / "text.txt").write_text("hello world\n")
    assert main(["data", "encode", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "text.txt"),
                 "--out", str(tmp_path / "text.tok"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "tok" / "tokenizer.json") in err and "'Unigram'" in err
    assert not (tmp_path / "text.tok").exists()
