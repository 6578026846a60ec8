"""benchmarks/gpu.py in its CPU mode (``--quick``): the script that measures what only a GPU can show must
not rot between the sessions lent a GPU. Every section runs on the CPU at toy sizes against the real
parts (a local cluster, node agents, torch.distributed, DCP) and must end without an error, with the
integrity figures exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_every_section_on_a_cpu(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--quick", "--json", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    sections = report["sections"]
    assert set(sections) == {"primitives", "readback", "save", "dcp", "abort", "overhead", "agreement", "health", "llm"}
    failed = {name: s["error"] for name, s in sections.items() if "error" in s}
    assert not failed, failed
    readback = sections["readback"]
    assert readback["mismatched_saves"] == 0 and readback["unrecorded_saves"] == 0 and readback["pinned_bytes_left"] == 0
    assert readback["dcp_async_save_after"]["ok"], readback
    save = sections["save"]["32MiB"]
    assert save["restore_device_exact"] and save["restore_host_exact"], save
    assert sections["dcp"]["in_group_ok"] and sections["abort"]["reformed_collectives_ok"]
    agreement = sections["agreement"]
    assert agreement["device_words_equal_host"] and agreement["flip_seen"] and agreement["tensors"] == 308, agreement
    assert sections["health"]["node_state"] == "Schedulable", sections["health"]
    for name in ("llm-cold", "llm-warm"):
        row = sections["llm"][name]
        assert row["phase"] == "Succeeded" and row["attempts"] == 2 and "error" not in row, row
    assert (tmp_path / "gpu.json").exists() and (tmp_path / "gpu.md").read_text().startswith("Device: CPU (--quick)")
