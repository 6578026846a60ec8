"""Where nodes come from: the local backend (agent processes on this machine)."""
