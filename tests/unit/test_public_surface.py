"""The public Python surface is frozen: changing it must be deliberate (and change this test)."""

import unbroken


def test_top_level_names():
    assert sorted(unbroken.__all__) == ["Context", "__version__", "init"]
    assert callable(unbroken.init)


def test_context_fields_a_training_script_uses():
    fields = set(unbroken.Context.__dataclass_fields__)
    assert {"rank", "world_size", "local_rank", "job", "node", "attempt", "checkpoint"} <= fields
    assert callable(unbroken.Context.progress)
