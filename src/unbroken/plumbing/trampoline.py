"""Start a Python process that dies with its parent.

``python -c TRAMPOLINE <parent pid> <python's arguments>`` (:func:`command` builds it) sets PDEATHSIG, then execs
Python with the rest: if the parent dies (an agent on a node losing power, a warm spare killed), the kernel kills
the child too. A parent that died before the request took effect is one that is no longer the child's parent (its pid
comes as the first argument): not "the parent is PID 1", since a launcher that is a container's command *is* PID 1
(``unbroken run`` in a pod: that test ended every torchrun it started at once). A trampoline instead of
``preexec_fn`` because the parents are multi-threaded and ``preexec_fn`` is not fork-safe there. PDEATHSIG follows
the parent *thread*: start such children from a thread that lives as long as the parent.
"""

from __future__ import annotations

import os
import sys

TRAMPOLINE = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
    "os.getppid() != int(sys.argv[1]) and os._exit(137); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def command(*python_args: str, code: str = TRAMPOLINE) -> list[str]:
    """``python -c TRAMPOLINE <this process's pid> *python_args``: Python run with ``python_args``, dying with us."""
    return [sys.executable, "-c", code, str(os.getpid()), *python_args]
