"""The rank's side of checkpointing: what runs in a training process. The checkpointers behind
``ctx.checkpoint`` (``file``, ``tiered`` with its ``tiers`` and overlapped ``device_copy``, ``live``),
the storage for ``torch.distributed.checkpoint`` (``dcp``), the restore path onto the device
(``device_restore``), the collectives a restore agrees through, RNG capture and the optimizer's
``fence``. It reads the node's stores (``checkpoint.node``: shared-memory slots, peers, the
persistent tier) and writes the ``checkpoint.format``; the node's side never imports it."""
