"""What each rank under ``unbroken run`` runs first: the job-wide torch.distributed variables, then the script.

The pod's torchrun runs alone (``--nnodes 1``), so the RANK, WORLD_SIZE and
MASTER_ADDR/PORT it gives its ranks are the pod's own. ``unbroken.init()`` puts the
job's in their place; a script that never calls it (plain ``init_process_group``)
must not train as a job of one pod, so this entrypoint sets them before the script
runs, from the round's placement (``UNBROKEN_GROUP_RANK``, ``UNBROKEN_NNODES``,
``UNBROKEN_RENDEZVOUS``). Such a script gets warm, in-place restarts of every pod
(its ranks exit when the group fails) and resumes from its own checkpoint.

Run as ``python -m unbroken.kubernetes.pod_launcher.rank <script args | -m module args>``.
"""

from __future__ import annotations

import os
import sys

from unbroken.supervision import rank_entry
from unbroken.rank.env import GroupPlacement


def main(argv: list[str]) -> None:
    group = GroupPlacement.from_environ(os.environ)
    if group is not None:
        os.environ.update(group.rank_environ(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    rank_entry.run_script(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
