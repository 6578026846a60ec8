"""The node's side of checkpointing: what the node agent runs (``service``, the agent's half of the
memory tier, and ``plan``, its pure decisions) and the stores both sides use: shared-memory slots
(``shm``, pinned through ``cuda_host``), peers over mutual TLS (``peer``, ``credentials``) and the
persistent tier (``persistent``, fsspec). It imports only ``checkpoint.format``."""
