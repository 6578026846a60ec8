"""What ``make install`` put into the virtualenv (a fresh clone once got the 5 GB CUDA build here)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
NO_DRIVER = not Path("/proc/driver/nvidia/version").exists()


@pytest.mark.skipif(not NO_DRIVER, reason="a machine with an NVIDIA driver gets the CUDA build on purpose")
def test_a_machine_without_an_nvidia_driver_gets_the_cpu_build_of_torch():
    import torch

    assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__}: the CUDA build on a machine without a driver"
    cuda_runtime = sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                          if d.metadata["Name"].lower().startswith("nvidia-") and d.metadata["Name"].lower() != "nvidia-ml-py")
    assert cuda_runtime == [], f"CUDA runtime packages installed for nothing: {cuda_runtime}"


def test_torch_is_a_library_range_so_a_users_own_torch_is_kept():
    """An exact pin would make pip replace a user's CUDA torch with the registry's build."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = next(d for d in dependencies if d.split(">")[0].split("=")[0].split("<")[0].strip() == "torch")
    assert "==" not in torch_spec and ">=" in torch_spec, torch_spec
