"""What runs in a training rank's process beside ``unbroken.train``: the environment the launcher
sets (``env``), the datagrams to the node agent (``channel``), a warm-spare rank's registry
(``registry``), in-process restarts (``rejoin``, ``leave_watch``, ``group_sockets``), the
symptoms a rank reports on its way out (``symptoms``) and GPU section timing (``gpu_sections``).

The node agent reads the other side of several of these (the registry, the channel, the rejoin
folder), so the package sits low in the layers: below the subsystems, above state and plumbing."""
