"""What ``make install`` put into the virtualenv (a fresh clone once got the 5 GB CUDA build here)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
NO_DRIVER = not Path("/proc/driver/nvidia/version").exists()


def makefile_torch_version() -> str:
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("TORCH_VERSION"))
    return line.split("=", 1)[1].strip()


def cpu_wheel_where_pip_finds_it() -> Path | None:
    """A CPU build of the Makefile's torch in one of pip's find-links folders (``PIP_FIND_LINKS``)."""
    version = makefile_torch_version()
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        found = sorted(Path(folder).glob(f"torch-{version}+cpu-*.whl")) if Path(folder).is_dir() else []
        if found:
            return found[0]
    return None


@pytest.mark.skipif(not NO_DRIVER, reason="a machine with an NVIDIA driver gets the CUDA build on purpose")
def test_a_machine_without_an_nvidia_driver_gets_the_cpu_build_of_torch_where_pip_finds_one():
    """The CPU build where pip finds it (a local wheel; PyTorch's CPU index where reachable), else the registry's
    build of the same version, which also runs on a CPU (the development machines reach neither)."""
    import torch

    if cpu_wheel_where_pip_finds_it() is None and not torch.__version__.endswith("+cpu"):
        assert torch.__version__.split("+")[0] == makefile_torch_version(), f"torch {torch.__version__}: not the Makefile's version"
        return
    assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__}: the CUDA build on a machine without a driver"
    cuda_runtime = sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                          if d.metadata["Name"].lower().startswith("nvidia-") and d.metadata["Name"].lower() != "nvidia-ml-py")
    assert cuda_runtime == [], f"CUDA runtime packages installed for nothing: {cuda_runtime}"


def test_torch_is_a_library_range_so_a_users_own_torch_is_kept():
    """An exact pin would make pip replace a user's CUDA torch with the registry's build."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = next(d for d in dependencies if d.split(">")[0].split("=")[0].split("<")[0].strip() == "torch")
    assert "==" not in torch_spec and ">=" in torch_spec, torch_spec
