"""What a failed worker's exit says, read from a real torchrun's logs: the rank, its exit, and the
exception it died of, also for a plain script that never imports unbroken."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from unbroken.supervision.torchrun import describe_exit, root_cause

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
    assert root_cause(tmp_path) is None, "nothing to name an unread rank's end with"


TORCHRUN_SIGTERM_NAMED_ROOT_CAUSE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
unbroken.workloads.mlp FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_02:58:08
  host      : node-1
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 101)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_02:58:08
  host      : node-1
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 100)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 100
============================================================
"""


def test_a_sibling_stopped_by_torchrun_is_not_blamed_over_the_rank_that_failed(tmp_path: Path) -> None:
    """Seen in a full run: rank 1 exited 3, torchrun SIGTERMed rank 0 the same second and named it the root cause."""
    (tmp_path / "torchrun.log").write_text(TORCHRUN_SIGTERM_NAMED_ROOT_CAUSE)
    assert describe_exit(1, tmp_path) == (3, "rank 1 (local rank 1) exited with code 3")


def test_when_every_rank_was_sigtermed_that_is_the_exit(tmp_path: Path) -> None:
    only_sigterm = TORCHRUN_SIGTERM_NAMED_ROOT_CAUSE.replace("exitcode  : 3 (pid: 101)", "exitcode  : -15 (pid: 101)")
    (tmp_path / "torchrun.log").write_text(only_sigterm)
    assert describe_exit(1, tmp_path) == (-15, "rank 0 (local rank 0) exited with signal 15 (SIGTERM)")
