"""``unbroken data prepare-text`` on small real inputs: the stream it writes, and every input it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from helpers import run_cli
from unbroken.data.prepare_text import prepare_text
from unbroken.data.token_shards import INDEX, TOKENIZER, TokenStream, read_index
from unbroken.errors import ConfigError

LINES = [f"Verse {i}: and the light was {'good ' * (i % 5)}in the morning of day {i}." for i in range(400)]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES[:200]) + "\n\n" + "\n".join(LINES[200:]) + "\n")
    return path


def test_the_shards_hold_every_document_in_order_each_ended_by_end_of_text(corpus: Path, tmp_path: Path) -> None:
    index = prepare_text([corpus], tmp_path / "out", vocab_size=300, shard_tokens=1000)
    assert index.complete and index.dtype == "uint16" and len(index.shards) > 3
    assert all(s.tokens == 1000 for s in index.shards[:-1]) and 0 < index.shards[-1].tokens <= 1000
    stream = TokenStream(tmp_path / "out")
    tokens = stream.window(0, stream.tokens)
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    documents = [tokenizer.decode(list(d)) for d in np.split(tokens, np.flatnonzero(tokens == index.eos_id) + 1) if len(d)]
    assert documents == LINES  # the empty line is no document; decode drops <|endoftext|>


def test_a_window_across_a_shard_boundary_reads_both_shards(corpus: Path, tmp_path: Path) -> None:
    prepare_text([corpus], tmp_path / "out", vocab_size=300, shard_tokens=1000)
    stream = TokenStream(tmp_path / "out")
    whole = stream.window(0, stream.tokens)
    assert np.array_equal(stream.window(2, 450), whole[900:1350])  # shards 0 and 1
    assert stream.windows(450) == stream.tokens // 450
    with pytest.raises(IndexError):
        stream.window(stream.windows(450), 450)


def test_jsonl_documents_come_from_their_text_field_and_a_given_tokenizer_is_used(corpus: Path, tmp_path: Path) -> None:
    first = prepare_text([corpus], tmp_path / "a", vocab_size=300, shard_tokens=1000)
    records = tmp_path / "corpus.jsonl"
    records.write_text("".join(json.dumps({"id": i, "text": line}) + "\n" for i, line in enumerate(LINES)))
    second = prepare_text([records], tmp_path / "b", tokenizer=tmp_path / "a" / TOKENIZER, shard_tokens=1000)
    assert [s.sha256 for s in second.shards] == [s.sha256 for s in first.shards]
    assert second.tokenizer_sha256 == first.tokenizer_sha256


@pytest.mark.parametrize(("content", "message"), [
    (b"fine\n\xff\xfe broken\n", "byte 5: not UTF-8 text"),
])
def test_text_that_is_not_utf8_is_refused_naming_the_byte(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        prepare_text([path], tmp_path / "out", vocab_size=300)


@pytest.mark.parametrize(("line", "message"), [
    ('{"body": "no text field"}', r"byte 0: no string field 'text' \(fields: \['body'\]\)"),
    ("not json at all", "byte 0: not JSON"),
])
def test_bad_jsonl_is_refused_naming_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        prepare_text([path], tmp_path / "out", vocab_size=300)
    assert not (tmp_path / "out" / INDEX).exists()


def test_other_options_or_a_changed_input_are_refused_rather_than_mixed_in(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_text([corpus], out, vocab_size=300, shard_tokens=1000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError, match="--shard-tokens 1000 vs 500; --vocab-size 300 vs 320"):
        prepare_text([corpus], out, vocab_size=320, shard_tokens=500)
    corpus.write_text(corpus.read_text() + "one more verse\n")
    with pytest.raises(ConfigError, match="holds shards of another preparation.*inputs"):
        prepare_text([corpus], out, vocab_size=300, shard_tokens=1000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_shard_changed_by_hand_is_refused_by_a_rerun_and_by_the_reader(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    index = prepare_text([corpus], out, vocab_size=300, shard_tokens=1000)
    (out / index.shards[1].name).write_bytes(b"\0\0" * 999)
    with pytest.raises(ConfigError, match="shard-00001.bin: missing or not the shard the index names"):
        prepare_text([corpus], out, vocab_size=300, shard_tokens=1000)
    with pytest.raises(ConfigError, match="shard-00001.bin: 1998 bytes, the index says 1000 uint16 tokens"):
        TokenStream(out)


def test_an_unfinished_folder_is_refused_by_the_reader_with_the_way_out(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    index = prepare_text([corpus], out, vocab_size=300, shard_tokens=1000)
    (out / INDEX).write_text(index.model_copy(update={"complete": False}).model_dump_json())
    with pytest.raises(ConfigError, match="preparation did not finish .*run the same unbroken data prepare-text command again"):
        TokenStream(out)
    (out / INDEX).write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match="index.json: format: .*expected an index written by unbroken data prepare-text"):
        read_index(out)


def test_the_cli_prints_a_summary_and_json_and_one_line_errors(corpus: Path, tmp_path: Path) -> None:
    done = run_cli("data", "prepare-text", str(corpus), "--out", str(tmp_path / "out"), "--vocab-size", "300",
                   "--shard-tokens", "1000", "-o", "json")
    summary = json.loads(done.stdout)
    assert summary["complete"] is True and summary["vocab_size"] == 300 and summary["shards"] == len(read_index(tmp_path / "out").shards)
    failed = run_cli("data", "prepare-text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x"), check=False)
    assert failed.returncode == 2 and failed.stderr.strip() == f"error: {tmp_path / 'missing.txt'}: no such file"
