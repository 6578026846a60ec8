"""The ``unbroken`` command line: one module per command group."""
