"""Check families, one module each; every function takes a CheckContext and returns an Outcome."""
