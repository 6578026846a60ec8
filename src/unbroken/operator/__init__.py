"""``unbroken operator``: the controller on Kubernetes (kopf watches, the shared reconcilers)."""
