"""``unbroken run``'s entry point: read the arguments, log as JSON lines, run the pod's launcher."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from unbroken.plumbing import logs
from unbroken.errors import ConfigError
from unbroken.kubernetes.pod_launcher import arguments, member

RUN_DIR = "UNBROKEN_RUN_DIR"
"""Where the launcher keeps each round's torchrun logs and the ranks' rejoin files (default: a new folder in /tmp)."""


def main(argv: list[str]) -> int:
    try:
        run = arguments.parse(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    run_dir = Path(os.environ[RUN_DIR]) if os.environ.get(RUN_DIR) else Path(tempfile.mkdtemp(prefix="unbroken-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    logs.setup(component="launcher", node_rank=run.node_rank, run_dir=str(run_dir))
    try:
        return member.serve(run, run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
