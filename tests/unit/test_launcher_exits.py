"""What a failed worker's exit says, read from a real torchrun's logs: the rank, its exit, and the
exception it died of, also for a plain script that never imports unbroken."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from unbroken.agent.launcher import describe_exit

PLAIN = """
import os, sys
if os.environ["LOCAL_RANK"] == "1":
    raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40123")
"""


def test_a_plain_scripts_exception_names_the_failure(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    with open(log_dir / "torchrun.log", "wb") as out:
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
                               "--log-dir", str(log_dir), "--redirects", "3", str(script)],
                              stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
    assert code != 0
    exit_code, message = describe_exit(code, log_dir)
    assert exit_code == 1
    assert message == ("rank 1 (local rank 1) exited with code 1: RuntimeError: [gloo/transport/tcp/pair.cc:534] "
                       "Connection closed by peer [127.0.0.1]:40123"), message


def test_without_a_root_cause_block_the_message_is_torchruns_own_exit(tmp_path: Path) -> None:
    (tmp_path / "torchrun.log").write_text("torchrun was killed before it could say anything\n")
    assert describe_exit(-9, tmp_path) == (-9, "torchrun exited with signal 9 (SIGKILL)")
