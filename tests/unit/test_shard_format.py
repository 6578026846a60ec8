"""The shard byte format, its descriptors and the tier policies: pure code, real torch, no I/O."""

from __future__ import annotations

import collections
import fractions
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_file_checkpoint import assert_same, sample_state

from unbroken.checkpoint.format import shard
from unbroken.checkpoint.format.manifest import ShardInfo, StepManifest
from unbroken.config.checkpoint import MemoryTier, PersistentTier, TierPolicy
from unbroken.config.job import JobSpec
from unbroken.config.loading import validate_mapping
from unbroken.errors import CheckpointError, ConfigError


def round_trip(state: Any, *, slack: int = 0, copy: bool = True) -> tuple[Any, shard.ShardLayout, bytearray]:
    """plan → write into a buffer (``slack`` extra stale bytes, like a reused slot) → read."""
    layout, tensors = shard.plan(state)
    buffer = bytearray(b"\xa5" * (layout.size + slack))
    shard.write(buffer, layout, tensors)
    return shard.read(buffer, layout.tensors, layout.skeleton_offset, layout.size, copy=copy), layout, buffer


def random_bits(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game (NaN payloads, denormals, -0.0, infinities)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g).view(dtype)


BIT_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
]


# -- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", BIT_DTYPES, ids=str)
def test_every_bit_pattern_of_every_dtype_round_trips(dtype: torch.dtype) -> None:
    tensor = random_bits(dtype, 257, seed=BIT_DTYPES.index(dtype))
    out, layout, _ = round_trip({"t": tensor, "after": torch.ones(3)})
    assert_same(out["t"], tensor)
    assert layout.tensors[0].dtype == str(dtype).removeprefix("torch.")
    assert all(meta.offset % shard.ALIGN == 0 for meta in layout.tensors), "tensors start 64-byte aligned"


def test_special_values_and_integer_extremes_round_trip() -> None:
    state = {
        "floats": torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.4e38]),
        "doubles": torch.tensor([float("nan"), -0.0, 5e-324, 1.7976931348623157e308], dtype=torch.float64),
        "bf16": torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, 3.3e38]).to(torch.bfloat16),
        "int64": torch.tensor([-(2**63), 2**63 - 1, 0, -1], dtype=torch.int64),
        "int32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "uint8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True, True, False]),
        "bool2d": torch.rand(7, 3, generator=torch.Generator().manual_seed(1)) > 0.5,
    }
    out, _, _ = round_trip(state)
    assert_same(out, state)
    assert torch.signbit(out["floats"][4]) and torch.signbit(out["doubles"][1]), "-0.0 keeps its sign"


def test_non_contiguous_views_come_back_with_their_values_contiguous() -> None:
    base = torch.arange(60.0).reshape(3, 4, 5)
    views = {
        "transposed": base.transpose(0, 2),
        "stepped": base[:, ::2, 1::2],
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0: 3 numbers stand for 12
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "offset": base.reshape(-1)[7:19],
        "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
    }
    out, _, _ = round_trip(views)
    for key, view in views.items():
        expected = view.resolve_conj().contiguous()
        assert_same(out[key], expected, key)
        assert out[key].is_contiguous()


def test_empty_and_zero_dim_tensors_keep_their_shapes() -> None:
    state = {
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, 2, dtype=torch.float64),
        "empty_int": torch.empty(0, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "scalar_bool": torch.tensor(True),
        "scalar_bf16": torch.tensor(-0.0, dtype=torch.bfloat16),
        "after": torch.arange(5),
    }
    out, layout, _ = round_trip(state)
    assert_same(out, state)
    assert [m.nbytes for m in layout.tensors] == [0, 0, 0, 4, 1, 2, 40]


def test_only_empty_tensors_and_no_tensors_at_all() -> None:
    for state in ({"e": torch.empty(0, 4)}, {"nothing": None}, {}, [], 7):
        out, layout, _ = round_trip(state)
        assert_same(out, state)
        assert layout.size == layout.skeleton_offset + len(layout.skeleton)


class Schedule:
    """A user's own class in the state: pickled by reference, as torch.save would."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and other.warmup == self.warmup


def test_nested_containers_and_python_values_round_trip_with_their_types() -> None:
    shared = torch.randn(4)
    state = {
        "ordered": collections.OrderedDict([("z", torch.ones(2)), ("a", torch.zeros(3, dtype=torch.int16))]),
        "tuple": (torch.tensor(1), (torch.tensor([2.0]), "x"), []),
        "list": [[torch.arange(3)], {"deep": {"deeper": [torch.tensor([True])]}}],
        0: "int key",
        (1, 2): "tuple key",
        "python": {
            "none": None, "true": True, "int": -(2**100), "float": -0.0, "inf": math.inf, "complex": 1 - 2j,
            "str": "héllo\n", "bytes": b"\x00\xff", "set": {1, 2}, "frozenset": frozenset({"a"}),
            "fraction": fractions.Fraction(1, 3), "range": range(3), "dtype": torch.bfloat16,
            "device": torch.device("cpu"), "size": torch.Size([2, 3]), "path": Path("/a/b"), "object": Schedule(100),
        },
        "twice": [shared, shared],  # the same tensor twice: written twice, read as two tensors
    }
    out, layout, _ = round_trip(state)
    assert_same(out, state)
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["z", "a"]
    assert math.copysign(1.0, out["python"]["float"]) == -1.0
    assert len(layout.tensors) == 8


def test_a_real_model_and_optimizer_state_round_trip() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sample": sample_state(3)}
    out, _, _ = round_trip(state)
    assert_same(out, state)
    clone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    clone.load_state_dict(out["model"])
    optimizer2 = torch.optim.AdamW(clone.parameters(), lr=1e-3)
    optimizer2.load_state_dict(out["optimizer"])


def test_read_copies_by_default_and_views_the_buffer_otherwise() -> None:
    state = {"w": torch.arange(16, dtype=torch.float32)}
    copied, layout, buffer = round_trip(state)
    viewed = shard.read(buffer, layout.tensors, layout.skeleton_offset, layout.size, copy=False)
    buffer[layout.tensors[0].offset : layout.tensors[0].offset + 64] = b"\0" * 64  # the slot is reused
    assert_same(copied, state)
    assert torch.equal(viewed["w"][:16], torch.zeros(16)), "copy=False reads the buffer in place"


def test_stale_bytes_after_the_shard_change_neither_the_data_nor_the_checksum() -> None:
    state = sample_state(4)
    _, layout, exact = round_trip(state)
    out, _, padded = round_trip(state, slack=4096)
    assert_same(out, state)
    assert shard.checksum(padded, layout.size) == shard.checksum(exact, layout.size)


@pytest.mark.parametrize("make", [lambda: torch.eye(3).to_sparse(), lambda: torch.empty(3, device="meta")], ids=["sparse", "meta"])
def test_sparse_or_meta_tensors_are_refused_by_plan(make) -> None:
    with pytest.raises(CheckpointError, match="optimizer"):
        shard.plan({"optimizer": {"embedding": make()}})


# -- checksum --------------------------------------------------------------------------------


def test_flipping_any_single_bit_changes_the_checksum() -> None:
    _, layout, buffer = round_trip({"w": torch.arange(40, dtype=torch.float32), "n": 7})
    original = shard.checksum(buffer, layout.size)
    assert original.startswith("xxh3_64c:") and len(original) == len("xxh3_64c:") + 16
    seen = {original}
    for position in range(layout.size):
        for bit in (0, 7):
            buffer[position] ^= 1 << bit
            flipped = shard.checksum(buffer, layout.size)
            buffer[position] ^= 1 << bit
            assert flipped != original, f"bit {bit} of byte {position} went unnoticed"
            seen.add(flipped)
    assert shard.checksum(buffer, layout.size) == original
    assert len(seen) == 2 * layout.size + 1


def test_streaming_checksum_matches_the_one_shot_checksum() -> None:
    _, layout, buffer = round_trip(sample_state(2))
    stream = shard.StreamingChecksum()
    for start in range(0, layout.size, 97):
        stream.update(memoryview(buffer)[start : min(start + 97, layout.size)])
    assert stream.hexdigest() == shard.checksum(buffer, layout.size)
    assert shard.StreamingChecksum().hexdigest() == shard.checksum(b"", 0)


def test_a_shard_of_many_chunks_hashes_on_threads_as_a_stream_would_and_a_whole_file_checksum_still_verifies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The checksum is chunked (each 32 MiB chunk hashed on its own core, then combined: the 8 GiB shard of an H100
    took 0.4 s on one); a chunk moved, a bit flipped, or the size changed each change it. Shards written before it
    carry one xxh3-64 of all their bytes (``xxh3_64:``) and still verify, computed ``like`` their own."""
    import xxhash

    from unbroken.checkpoint.format import integrity

    monkeypatch.setattr(integrity, "CHUNK_BYTES", 1000)
    data = bytearray(torch.randint(0, 256, (10_500,), dtype=torch.uint8).numpy().tobytes())
    parallel = integrity.checksum(data, len(data))
    stream = integrity.StreamingChecksum()
    for start in range(0, len(data), 333):
        stream.update(data[start : start + 333])
    assert stream.hexdigest() == parallel
    swapped = data[1000:2000] + data[:1000] + data[2000:]
    assert integrity.checksum(swapped, len(swapped)) != parallel, "chunks in another order"
    assert integrity.checksum(data + b"\0", len(data) + 1) != parallel, "one more (zero) byte"

    old = f"xxh3_64:{xxhash.xxh3_64(bytes(data)).hexdigest()}"
    assert integrity.checksum(data, len(data), like=old) == old
    legacy = integrity.StreamingChecksum(like=old)
    legacy.update(data)
    assert legacy.hexdigest() == old


def test_a_flipped_byte_in_the_skeleton_is_caught_by_the_checksum_even_when_it_still_unpickles() -> None:
    state = {"lr": 0.25, "name": "abcdefgh"}
    _, layout, buffer = round_trip(state)
    good = shard.checksum(buffer, layout.size)
    at = bytes(buffer).index(b"abcdefgh")
    buffer[at] ^= 0x02  # "cbcdefgh": still a valid pickle
    out = shard.read(buffer, layout.tensors, layout.skeleton_offset, layout.size)
    assert out["name"] != "abcdefgh", "the corruption reaches the state unless the checksum is checked"
    assert shard.checksum(buffer, layout.size) != good


# -- descriptors -----------------------------------------------------------------------------


def describe(step: int = 5, rank: int = 0, world_size: int = 1, attempt: int = 0) -> ShardInfo:
    _, layout, buffer = round_trip(sample_state(step, rank))
    return ShardInfo.describe(job="j", step=step, rank=rank, world_size=world_size, attempt=attempt, layout=layout,
                              checksum=shard.checksum(buffer, layout.size))


def test_shard_info_encodes_and_decodes_to_the_same_value() -> None:
    info = describe()
    assert ShardInfo.decode(info.encode(), source="x") == info
    assert ShardInfo.decode(info.encode().decode(), source="x") == info
    assert info.metas() == shard.plan(sample_state(5, 0))[0].tensors
    assert info.size == shard.plan(sample_state(5, 0))[0].size


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"\xff\xfe\x00", b"[]", b"{}", b'{"job": "j"}', b"null"],
    ids=["empty", "text", "binary", "list", "empty-object", "partial", "null"],
)
def test_a_broken_shard_descriptor_is_a_checkpoint_error_naming_its_source(data: bytes) -> None:
    with pytest.raises(CheckpointError) as err:
        ShardInfo.decode(data, source="/dev/shm/x/own/j/a0000-r00000-s1.json")
    message = str(err.value)
    assert message.startswith("/dev/shm/x/own/j/a0000-r00000-s1.json: not a shard descriptor"), message
    assert "\n" not in message


@pytest.mark.parametrize(
    "change",
    [{"step": -1}, {"rank": -3}, {"world_size": 0}, {"size": -1}, {"tensors": "x"}, {"surprise": 1}, {"step": "ten"}],
    ids=["step", "rank", "world", "size", "tensors", "unknown-field", "type"],
)
def test_a_descriptor_with_an_invalid_field_is_refused(change: dict[str, Any]) -> None:
    raw = {**describe().model_dump(mode="json"), **change}
    with pytest.raises(CheckpointError, match="^peer node-2: not a shard descriptor"):
        ShardInfo.decode(json.dumps(raw), source="peer node-2")


def test_reading_a_missing_descriptor_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "gone.json"
    with pytest.raises(CheckpointError, match=f"^{path}: cannot read shard descriptor"):
        ShardInfo.read(path)
    path.write_bytes(b"{truncated")
    with pytest.raises(CheckpointError, match=f"^{path}: not a shard descriptor"):
        ShardInfo.read(path)


def test_step_manifest_round_trip_and_its_errors() -> None:
    shards = (describe(rank=0, world_size=2), describe(rank=1, world_size=2))
    manifest = StepManifest(job="j", step=5, world_size=2, attempt=0, shards=shards)
    back = StepManifest.decode(manifest.model_dump_json().encode(), source="s3://b/j/step-000000005/manifest.json")
    assert back == manifest and back.shard(1) == shards[1] and back.size == sum(s.size for s in shards)

    source = "s3://b/j/step-000000005/manifest.json"
    for data in (b"", b"garbage", b"{}", manifest.model_dump_json().encode()[:-10]):
        with pytest.raises(CheckpointError, match=f"^{source}: not a step manifest"):
            StepManifest.decode(data, source=source)

    missing = manifest.model_copy(update={"shards": shards[:1]})
    with pytest.raises(CheckpointError, match=r"j step 5: ranks \[0\] do not cover world size 2"):
        StepManifest.decode(missing.model_dump_json().encode(), source=source)
    mixed = manifest.model_copy(update={"shards": (shards[0], describe(rank=1, world_size=2, attempt=1))})
    with pytest.raises(CheckpointError, match="more than one attempt"):
        StepManifest.decode(mixed.model_dump_json().encode(), source=source)
    duplicated = manifest.model_copy(update={"shards": (shards[0], shards[0])})
    with pytest.raises(CheckpointError, match="do not cover"):
        StepManifest.decode(duplicated.model_dump_json().encode(), source=source)
    with pytest.raises(CheckpointError, match="no shard for rank 7"):
        manifest.shard(7)


# -- policies --------------------------------------------------------------------------------


def load_checkpoint(checkpoint: dict[str, Any]) -> JobSpec:
    return validate_mapping({"name": "j", "command": ["x.py"], "checkpoint": checkpoint}, JobSpec, source="job.yaml",
                            context={"trusted": True})


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("gs://bucket/runs", "scheme must be one of file://, s3://"),
        ("http://host/x", "scheme must be one of file://, s3://"),
        ("/data/ckpt", "scheme must be one of file://, s3://"),
        ("data/ckpt", "scheme must be one of file://, s3://"),
        ("file:data/ckpt", "a file:// uri needs an absolute path"),
        ("file:", "a file:// uri needs an absolute path"),
        ("s3://", "an s3:// uri needs a bucket"),
        ("s3:///runs", "an s3:// uri needs a bucket"),
    ],
)
def test_a_bad_persistent_uri_is_a_config_error_naming_field_value_and_fix(uri: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_checkpoint({"memory": {}, "persistent": {"uri": uri, "every_steps": 10}})
    message = str(err.value)
    assert message.startswith("job.yaml: checkpoint.persistent.uri: ") and repr(uri) in message and expected in message, message
    assert "\n" not in message


@pytest.mark.parametrize("uri", ["file://relative/path", "file://./ckpt", "file://localhost/data"])
def test_a_file_uri_with_a_host_part_is_refused(uri: str) -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        load_checkpoint({"memory": {}, "persistent": {"uri": uri, "every_steps": 10}})


def test_good_persistent_uris_are_accepted_and_normalised() -> None:
    spec = load_checkpoint({"memory": {"keep": 3, "replicas": 2, "every_steps": 50},
                            "persistent": {"uri": "s3://bucket/runs/", "every_seconds": 600, "keep": 5}})
    tiers = spec.checkpoint.tiers
    assert tiers == TierPolicy(memory=MemoryTier(every_steps=50, keep=3, replicas=2),
                               persistent=PersistentTier(uri="s3://bucket/runs", every_seconds=600, keep=5))
    assert load_checkpoint({"memory": {}, "persistent": {"uri": "file:///data/ckpt", "every_steps": 1}}).checkpoint.persistent.uri == "file:///data/ckpt"
    assert load_checkpoint({}).checkpoint.tiers is None, "no memory: the file checkpointer"
    assert load_checkpoint({"memory": {}}).checkpoint.tiers == TierPolicy()


def test_persistent_without_a_cadence_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"set every_steps and/or every_seconds \(e.g. every_seconds: 600\)"):
        load_checkpoint({"memory": {}, "persistent": {"uri": "s3://bucket/runs"}})
    with pytest.raises(ValueError, match="set every_steps and/or every_seconds"):
        TierPolicy(persistent=PersistentTier(uri="s3://bucket/runs"))


def test_persistent_without_memory_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"persistent needs memory.*add 'memory: \{\}'"):
        load_checkpoint({"persistent": {"uri": "s3://bucket/runs", "every_steps": 10}})


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        ({"memory": {"every_step": 5}}, "checkpoint.memory.every_step: unknown field; did you mean 'every_steps'?"),
        ({"memory": {"keep": 0}}, "checkpoint.memory.keep: 0 is invalid"),
        ({"memory": {"keep": 17}}, "checkpoint.memory.keep: 17 is invalid"),
        ({"memory": {"replicas": 9}}, "checkpoint.memory.replicas: 9 is invalid"),
        ({"memory": {"every_seconds": 0}}, "checkpoint.memory.every_seconds: 0 is invalid"),
        ({"memory": {"every_steps": 0}}, "checkpoint.memory.every_steps: 0 is invalid"),
        ({"memory": {}, "persistent": {"uri": "s3://b", "every_steps": 1, "keep": 0}}, "checkpoint.persistent.keep: 0 is invalid"),
        ({"memory": {}, "persistent": {"every_steps": 1}}, "checkpoint.persistent.uri: required field is missing"),
    ],
)
def test_other_policy_mistakes_are_config_errors(checkpoint: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_checkpoint(checkpoint)
    assert expected in str(err.value), str(err.value)


# -- MemoryTier.due --------------------------------------------------------------------------


def test_due_every_steps_takes_multiples_only() -> None:
    tier = MemoryTier(every_steps=50)
    taken = [s for s in range(0, 201) if tier.due(s, last_step=None, seconds_since_last=None)]
    assert taken == [0, 50, 100, 150, 200]
    assert not tier.due(50, last_step=50, seconds_since_last=1e9), "a step is never taken twice"
    assert not tier.due(50, last_step=100, seconds_since_last=1e9), "nor an older one"
    assert tier.due(150, last_step=100, seconds_since_last=0.0), "seconds do not matter without every_seconds"


def test_due_every_seconds_takes_the_first_step_then_waits() -> None:
    tier = MemoryTier(every_seconds=60)
    assert tier.due(7, last_step=None, seconds_since_last=None)
    assert not tier.due(8, last_step=7, seconds_since_last=59.9)
    assert tier.due(9, last_step=7, seconds_since_last=60.0)
    assert not tier.due(7, last_step=7, seconds_since_last=600.0)


def test_due_with_both_settings_takes_either() -> None:
    tier = MemoryTier(every_steps=100, every_seconds=60)
    assert tier.due(200, last_step=150, seconds_since_last=1.0), "a multiple, however recent"
    assert tier.due(151, last_step=150, seconds_since_last=61.0), "old enough, not a multiple"
    assert not tier.due(151, last_step=150, seconds_since_last=1.0)


def test_due_with_neither_setting_takes_every_newer_step() -> None:
    tier = MemoryTier()
    assert [s for s in (3, 3, 4, 2, 9) if tier.due(s, last_step=3, seconds_since_last=0.0)] == [4, 9]
    assert tier.due(0, last_step=None, seconds_since_last=None)
