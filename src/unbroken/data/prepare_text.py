"""``unbroken data prepare-text``: text files into token shards, resumable and deterministic.

Input: ``.txt`` files (one document per line, as line-oriented corpora ship) and
``.jsonl`` files (one JSON object per line, the document in its ``"text"`` field, as
most web corpora ship). Empty documents are skipped. Every document is tokenized on its
own and followed by the end-of-text token, so a document's tokens do not depend on its
neighbours: that is what lets a run resume from the middle of the stream.

The tokenizer is a byte-level BPE trained with Hugging Face ``tokenizers`` on the same
files (``--vocab-size``), or one given with ``--tokenizer`` (a ``tokenizer.json``,
for instance the one of the model being continued); nothing is downloaded.

Resuming: after every shard the index is rewritten (atomically) with the shards so far
and where the stream continues (source file, byte offset of the first document not
wholly written, how many of its tokens are). A run killed at any point and started
again with the same arguments continues from there and writes the same bytes an
uninterrupted run writes; different arguments or changed inputs are refused, naming
what differs, rather than mixing two runs in one folder.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from unbroken.plumbing.atomic_file import write_atomically, write_bytes_atomically
from unbroken.data.token_shards import (
    END_OF_TEXT, INDEX, TOKENIZER, ResumePoint, Shard, ShardIndex, Source, dtype_for, read_index, shard_name,
)
from unbroken.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SUFFIXES = (".txt", ".jsonl")
BATCH_DOCUMENTS = 1024  # documents per encode_batch call: big enough for its threads, small enough to resume near
MIN_VOCAB = 257  # the 256 bytes and the end-of-text token

Progress = Callable[[int, int], None]
"""Called with (bytes read so far, bytes in all sources)."""


@dataclass(frozen=True)
class Document:
    source: int
    start: int
    """Byte offset of its line in the source."""
    end: int
    """Byte offset just past its line: where the next document starts."""
    text: str


def read_documents(sources: Sequence[Path], start: ResumePoint | None = None) -> Iterator[Document]:
    """Every non-empty document from ``start`` (default: the beginning) on, in order."""
    start = start or ResumePoint()
    for number in range(start.source, len(sources)):
        path = sources[number]
        with open(path, "rb") as f:
            offset = start.offset if number == start.source else 0
            f.seek(offset)
            for line in f:
                begin, offset = offset, offset + len(line)
                text = _document(path, begin, line)
                if text:
                    yield Document(number, begin, offset, text)


def _document(path: Path, offset: int, line: bytes) -> str:
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: byte {offset + exc.start}: not UTF-8 text ({exc.reason}); "
                          "convert the file to UTF-8 (iconv -t UTF-8) first") from None
    if path.suffix != ".jsonl":
        return decoded.rstrip("\r\n")
    if not decoded.strip():
        return ""
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: line at byte {offset}: not JSON ({exc.msg}); a .jsonl file holds one object per line") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ConfigError(f"{path}: line at byte {offset}: no string field 'text' (fields: {sorted(record) if isinstance(record, dict) else type(record).__name__})")
    return text


def train_tokenizer(sources: Sequence[Path], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over the sources' documents, the end-of-text token being id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.text for d in read_documents(sources)), trainer)
    return tokenizer


def _sources(inputs: Sequence[Path]) -> tuple[list[Path], tuple[Source, ...]]:
    if not inputs:
        raise ConfigError("no input files; give one or more .txt or .jsonl files")
    paths = []
    for path in inputs:
        if not path.is_file():
            raise ConfigError(f"{path}: no such file")
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"{path}: unknown kind of input {path.suffix or '(no suffix)'}; expected one of {', '.join(SUFFIXES)}")
        paths.append(path.resolve())
    return paths, tuple(Source(path=str(p), bytes=p.stat().st_size, mtime_ns=p.stat().st_mtime_ns) for p in paths)


def prepare_text(inputs: Sequence[Path], out: Path, *, vocab_size: int = 8192, shard_tokens: int = 2**24,
                 tokenizer: Path | None = None, progress: Progress | None = None) -> ShardIndex:
    """Tokenize ``inputs`` into shards under ``out``; continue a run that was interrupted there."""
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens {shard_tokens}: must be at least 1")
    if tokenizer is None and not MIN_VOCAB <= vocab_size <= 2**32:
        raise ConfigError(f"--vocab-size {vocab_size}: must be between {MIN_VOCAB} (the 256 bytes and end-of-text) and 2**32")
    paths, sources = _sources(inputs)
    out.mkdir(parents=True, exist_ok=True)
    index = _resumable_index(out, sources, shard_tokens, vocab_size if tokenizer is None else None)
    if index is None:
        index = _start(paths, sources, out, vocab_size, shard_tokens, tokenizer)
    if not index.complete:
        index = _tokenize(paths, out, index, progress)
    return index


def _resumable_index(out: Path, sources: tuple[Source, ...], shard_tokens: int, vocab_size: int | None) -> ShardIndex | None:
    """The index of an earlier run of the same arguments in ``out``, or None if there was none."""
    if not (out / INDEX).exists():
        return None
    index = read_index(out)
    differences = []
    if index.sources != sources:
        differences.append(f"inputs {[s.path for s in index.sources]} (sizes, mtimes) vs {[s.path for s in sources]}")
    if index.shard_tokens != shard_tokens:
        differences.append(f"--shard-tokens {index.shard_tokens} vs {shard_tokens}")
    if vocab_size is not None and index.vocab_size != vocab_size:
        differences.append(f"--vocab-size {index.vocab_size} vs {vocab_size}")
    tokenizer = out / TOKENIZER
    if not tokenizer.exists() or _sha256(tokenizer.read_bytes()) != index.tokenizer_sha256:
        differences.append(f"{tokenizer} is missing or not the one the index names")
    if differences:
        raise ConfigError(f"{out} holds shards of another preparation ({'; '.join(differences)}); "
                          "run with the same arguments to continue it, or choose an empty --out")
    for shard in index.shards:
        path = out / shard.name
        if not path.exists() or _sha256(path.read_bytes()) != shard.sha256:
            raise ConfigError(f"{path}: missing or not the shard the index names (sha256 {shard.sha256[:12]}...); "
                              "the folder was changed by hand; choose an empty --out")
    return index


def _start(paths: list[Path], sources: tuple[Source, ...], out: Path, vocab_size: int, shard_tokens: int,
           given: Path | None) -> ShardIndex:
    from tokenizers import Tokenizer

    if given is not None:
        try:
            trained = Tokenizer.from_file(str(given))
        except Exception as exc:  # tokenizers raises its own Exception subclasses for any bad file
            raise ConfigError(f"--tokenizer {given}: not a tokenizers JSON file ({exc})") from None
    else:
        trained = train_tokenizer(paths, vocab_size)
    eos = trained.token_to_id(END_OF_TEXT)
    if eos is None:
        raise ConfigError(f"--tokenizer {given}: has no {END_OF_TEXT} token to end documents with")
    encoded = trained.to_str().encode()
    write_bytes_atomically(out / TOKENIZER, encoded)
    size = trained.get_vocab_size()
    index = ShardIndex(dtype=dtype_for(size), vocab_size=size, eos_id=eos, shard_tokens=shard_tokens,
                       tokenizer_sha256=_sha256(encoded), sources=sources)
    _write_index(out, index)
    return index


@dataclass(frozen=True)
class _Span:
    """A document's place in the token stream: its tokens are ``[first, first + length)``."""
    document: Document
    first: int
    length: int


def _tokenize(paths: list[Path], out: Path, index: ShardIndex, progress: Progress | None) -> ShardIndex:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / TOKENIZER))
    dtype = np.dtype(index.dtype).newbyteorder("<")
    total = sum(s.bytes for s in index.sources)
    before = [sum(s.bytes for s in index.sources[:i]) for i in range(len(index.sources))]
    written = index.total_tokens  # stream position of the first token not in a shard
    stream = written  # stream position of the next token to enter the buffer
    buffer: list[np.ndarray] = []
    buffered = 0
    spans: deque[_Span] = deque()
    resume = index.resume
    skip = resume.skip_tokens

    def cut_shard() -> None:
        nonlocal written, buffered, buffer, index
        data = np.concatenate(buffer)
        shard, rest = data[: index.shard_tokens], data[index.shard_tokens :]
        buffer, buffered = ([rest] if len(rest) else []), len(rest)
        _write_shard(out, len(index.shards), shard)
        written += len(shard)
        while spans and spans[0].first + spans[0].length <= written and len(spans) > 1:
            spans.popleft()
        head = spans[0]
        if head.first + head.length > written:
            point = ResumePoint(source=head.document.source, offset=head.document.start, skip_tokens=written - head.first)
        else:
            point = ResumePoint(source=head.document.source, offset=head.document.end)
        index = index.model_copy(update={"shards": (*index.shards, Shard(name=shard_name(len(index.shards)), tokens=len(shard),
                                                                          sha256=_sha256(shard.tobytes()))),
                                         "resume": point})
        _write_index(out, index)

    batch: list[Document] = []

    def encode(documents: list[Document]) -> None:
        nonlocal stream, buffered, skip
        for document, encoding in zip(documents, tokenizer.encode_batch([d.text for d in documents], add_special_tokens=False), strict=True):
            tokens = np.array([*encoding.ids, index.eos_id], dtype=dtype)
            spans.append(_Span(document, stream - skip, len(tokens)))
            tokens, skip = tokens[skip:], 0
            buffer.append(tokens)
            buffered += len(tokens)
            stream += len(tokens)
            while buffered >= index.shard_tokens:
                cut_shard()
        if progress is not None and documents:
            progress(before[documents[-1].source] + documents[-1].end, total)

    for document in read_documents(paths, resume):
        batch.append(document)
        if len(batch) == BATCH_DOCUMENTS:
            encode(batch)
            batch = []
    encode(batch)
    if buffered:
        cut_shard()
    index = index.model_copy(update={"complete": True, "resume": ResumePoint(source=len(paths))})
    _write_index(out, index)
    if progress is not None:
        progress(total, total)
    return index


def _write_shard(out: Path, number: int, tokens: np.ndarray) -> None:
    write_atomically(out / shard_name(number), lambda f: f.write(tokens.tobytes()))


def _write_index(out: Path, index: ShardIndex) -> None:
    write_bytes_atomically(out / INDEX, index.model_dump_json(indent=1).encode())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

