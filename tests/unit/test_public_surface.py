"""The public Python surface is frozen: changing it must be deliberate (and change this test)."""

import unbroken


def test_top_level_names():
    assert sorted(unbroken.__all__) == ["Context", "__version__", "init"]
    assert callable(unbroken.init)


def test_context_fields_a_training_script_uses():
    fields = set(unbroken.Context.__dataclass_fields__)
    assert {"rank", "world_size", "local_rank", "job", "node", "attempt", "checkpoint"} <= fields
    assert callable(unbroken.Context.progress)


def test_the_node_agent_starts_without_importing_torch():
    """An agent has NodeLostAfterSeconds (4 s locally) to register; ``import torch`` takes 2+ s
    of CPU and far more on a busy node. The checkpoint service must stay torch-free."""
    import subprocess
    import sys

    code = "import sys, unbroken.agent.main, unbroken.controller.main; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr
