"""The local backend: nodes are agent processes on this machine (``backend``), each optionally in a
network namespace of its own (``netns_launch``). Its processes, the controller and the node agent, are
the generic ones (``controller/``, ``agent/``); the Kubernetes side's are in ``kubernetes/``."""
