"""`colibri-model train-tokenizer`: a small byte-level BPE that the data pipeline accepts as it is,
and one clear line (exit 2) for each kind of bad input."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from colibri_model.cli import main
from colibri_model.data.prepare import tokenizer_info
from colibri_model.tokenizer import EOS_TOKEN, IM_END, IM_START, TokenizerError, load_tokenizer
from colibri_model.tokenizer_training import train_bpe_tokenizer

TEXT = ("It was on a dreary night of November that I beheld the accomplishment of my toils.\n\n"
        "First Citizen: Before we proceed any further, hear me speak. Café, naïve, 東京.\n\n") * 40


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text" / "sample.txt"
    path.parent.mkdir()
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_trains_a_byte_level_bpe_the_pipeline_accepts(corpus, tmp_path):
    out = tmp_path / "tok" / "tokenizer.json"
    result = CliRunner().invoke(main, ["train-tokenizer", str(corpus.parent), "--vocab-size", "320", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "320 tokens" in result.output
    tokenizer = load_tokenizer(out)
    assert tokenizer.get_vocab_size() == 320
    assert [tokenizer.token_to_id(t) for t in (EOS_TOKEN, IM_START, IM_END)] == [0, 1, 2]
    ids = tokenizer.encode(TEXT[:200]).ids
    assert tokenizer.decode(ids) == TEXT[:200]  # byte-level: every string round-trips
    assert len(ids) < len(TEXT[:200].encode())  # and the merges compress it
    unseen = "Zebra quartz \u2603 \U0001F600"
    assert tokenizer.decode(tokenizer.encode(unseen).ids) == unseen
    _, info = tokenizer_info(str(out))  # what `prepare --tokenizer` checks
    assert info.vocab_size == 320 and info.eos_id == 0


def test_same_input_gives_the_same_tokenizer(corpus):
    a = train_bpe_tokenizer([corpus], vocab_size=300).to_str()
    b = train_bpe_tokenizer([corpus], vocab_size=300).to_str()
    assert a == b


def test_default_input_is_the_bundled_prose(tmp_path):
    out = tmp_path / "tokenizer.json"
    result = CliRunner().invoke(main, ["train-tokenizer", "--vocab-size", "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_tokenizer(out).encode("To be, or not to be").ids


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file or directory"),
    ("binary", "not UTF-8 text"),
    ("empty", "no text to train on"),
    ("wrong_suffix", "not a text file"),
    ("empty_dir", "holds no .txt/.md files"),
    ("vocab_small", "must be between 259"),
    ("vocab_large", "must be between 259"),
])
def test_bad_input_is_one_line_exit_2(case, message, tmp_path, corpus):
    args = [str(corpus)]
    vocab = "300"
    if case == "missing":
        args = [str(tmp_path / "nope.txt")]
    elif case == "binary":
        bad = tmp_path / "bad.txt"
        bad.write_bytes(b"caf\xe9 \xff\xfe")
        args = [str(bad)]
    elif case == "empty":
        empty = tmp_path / "empty.txt"
        empty.write_text("  \n\n")
        args = [str(empty)]
    elif case == "wrong_suffix":
        other = tmp_path / "data.parquet"
        other.write_bytes(b"PAR1")
        args = [str(other)]
    elif case == "empty_dir":
        (tmp_path / "nothing").mkdir()
        args = [str(tmp_path / "nothing")]
    elif case == "vocab_small":
        vocab = "100"
    elif case == "vocab_large":
        vocab = "70000"
    result = CliRunner().invoke(main, ["train-tokenizer", *args, "--vocab-size", vocab,
                                       "--out", str(tmp_path / "t.json")])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    if case in ("missing", "binary", "empty", "wrong_suffix"):
        assert args[0] in result.output  # names the file


def test_python_api_raises_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError, match="no input text"):
        train_bpe_tokenizer([])
