"""``unbroken operator``: the controller on Kubernetes (watch caches, the shared reconcilers)."""
