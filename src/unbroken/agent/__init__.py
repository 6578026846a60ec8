"""The node agent: one per node; registers, heartbeats, checks, runs the node's workers."""
