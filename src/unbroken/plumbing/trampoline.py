"""Start a Python process that dies with its parent.

``python -c TRAMPOLINE <python's arguments>`` sets PDEATHSIG, then execs Python with
the rest: if the parent dies (an agent on a node losing power, a warm spare killed),
the kernel kills the child too. A trampoline instead of ``preexec_fn`` because the
parents are multi-threaded and ``preexec_fn`` is not fork-safe there. PDEATHSIG
follows the parent *thread*: start such children from a thread that lives as long
as the parent.
"""

TRAMPOLINE = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
    "os.getppid() == 1 and os._exit(137); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
