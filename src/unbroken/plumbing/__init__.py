"""OS plumbing any layer may use, and none of unbroken's concepts: process trees (``procs``),
network namespaces and ``tc`` (``netns``), ports, HTTP binding, atomic files, the one poll-until
helper (``waiting``), the controller's doorbell, logging setup, a process's Prometheus registry
and endpoint (``metrics``), and where a local cluster keeps its files (``layout``)."""
