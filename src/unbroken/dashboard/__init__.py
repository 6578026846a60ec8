"""The read-only web dashboard (``unbroken dashboard``): FastAPI, live over server-sent events."""
