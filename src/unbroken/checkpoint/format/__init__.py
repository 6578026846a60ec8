"""What a checkpoint is, as bytes: the shard format (``shard``), a step's manifest (``manifest``),
chunked checksums (``integrity``) and the restore catalog's rows (``restore_catalog``). Pure: no
process, socket or device; both sides of checkpointing read and write it."""
