"""Token shards: a tokenized corpus as fixed-size binary files plus an index.

Layout of a prepared folder::

    <out>/tokenizer.json      the tokenizer (Hugging Face ``tokenizers`` format)
    <out>/index.json          this module's :class:`ShardIndex`
    <out>/shard-00000.bin     ``shard_tokens`` tokens, little-endian uint16 (vocab <= 65536) or uint32
    <out>/shard-00001.bin     ... the last shard may be shorter

The shards are one stream of tokens cut every ``shard_tokens``: documents run across
shard boundaries, each ends with the end-of-text token. Every file appears by an atomic
rename, the index last, so a reader trusts exactly the shards the index lists.

:class:`TokenStream` reads the stream through memory maps: ``window(i, n)`` is tokens
``[i*n, (i+1)*n)`` whether or not that crosses a shard boundary.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from unbroken.errors import ConfigError

FORMAT: Final = "unbroken-token-shards/1"
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.bin"


def dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class Source(BaseModel):
    """One input file, as it was when preparation started: a changed input is a different run."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    bytes: int
    mtime_ns: int


class Shard(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    tokens: int
    sha256: str


class ResumePoint(BaseModel):
    """Where the token stream continues after the last listed shard: the first document not
    wholly in a shard starts at byte ``offset`` of source ``source``, and its first
    ``skip_tokens`` tokens are already written."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    source: int = 0
    offset: int = 0
    skip_tokens: int = 0


class ShardIndex(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["unbroken-token-shards/1"] = FORMAT
    dtype: Literal["uint16", "uint32"]
    vocab_size: int
    eos_id: int
    shard_tokens: int
    tokenizer_sha256: str
    sources: tuple[Source, ...]
    shards: tuple[Shard, ...] = ()
    resume: ResumePoint = ResumePoint()
    complete: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


def read_index(folder: Path) -> ShardIndex:
    """The index of a prepared folder, or a :class:`ConfigError` that says what is wrong with it."""
    path = folder / INDEX
    try:
        return ShardIndex.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no {INDEX}; prepare the data first: unbroken data prepare-text CORPUS... --out {folder}") from None
    except (ValidationError, ValueError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p) for p in first["loc"]) or "(file)"
        raise ConfigError(f"{path}: {where}: {first['msg']}; expected an index written by unbroken data prepare-text "
                          f"({FORMAT})") from None


class TokenStream:
    """The tokens of a complete prepared folder as one read-only stream."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.index = read_index(folder)
        if not self.index.complete:
            raise ConfigError(f"{folder}: preparation did not finish ({len(self.index.shards)} shards so far); "
                              "run the same unbroken data prepare-text command again to complete it")
        for shard in self.index.shards:
            path = folder / shard.name
            size = path.stat().st_size if path.exists() else None
            if size != shard.tokens * np.dtype(self.index.dtype).itemsize:
                raise ConfigError(f"{path}: {'missing' if size is None else f'{size} bytes'}, the index says "
                                  f"{shard.tokens} {self.index.dtype} tokens; prepare the data again")

    @property
    def tokens(self) -> int:
        return self.index.total_tokens

    @cached_property
    def _maps(self) -> list[np.memmap]:
        return [np.memmap(self.folder / s.name, dtype=self.index.dtype, mode="r") for s in self.index.shards]

    def windows(self, length: int) -> int:
        """How many whole windows of ``length`` tokens the stream holds."""
        return self.tokens // length

    def window(self, number: int, length: int) -> np.ndarray:
        """Tokens ``[number*length, (number+1)*length)`` as int64."""
        start, end = number * length, (number + 1) * length
        if number < 0 or end > self.tokens:
            raise IndexError(f"window {number} of {length} tokens is outside the {self.tokens}-token stream")
        per_shard = self.index.shard_tokens
        parts = []
        while start < end:
            shard, offset = divmod(start, per_shard)
            take = min(end - start, per_shard - offset)
            parts.append(self._maps[shard][offset : offset + take])
            start += take
        return np.concatenate(parts).astype(np.int64)


def tokenizer_summary(folder: Path) -> dict[str, object]:
    """What ``unbroken data`` prints about a folder: counts, not tokens."""
    index = read_index(folder)
    return {"folder": str(folder), "complete": index.complete, "shards": len(index.shards), "tokens": index.total_tokens,
            "vocab_size": index.vocab_size, "dtype": index.dtype, "sources": [s.path for s in index.sources],
            "tokenizer": json.loads((folder / TOKENIZER).read_text())["model"]["type"] if (folder / TOKENIZER).exists() else None}
