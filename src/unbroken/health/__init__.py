"""Health checks: one catalogue, one result format, a hard timeout on every check.

- ``result``      Status, Suite, FaultAction, CheckResult
- ``catalogue``   every check: id, suites, timeout, where it runs
- ``runner``      runs a check in a child process it can kill (the timeout is real)
- ``checks/``     one module per check family (devices, stress, storage, network)
- ``collective``  the nccl-tests style bandwidth sweep across nodes
- ``kernel_log/`` node-problem-detector rules, the Xid table, log sources
- ``monitor``     the agent's continuous monitor
- ``faults``      pure: result or log match -> node action, fault type, reason
"""
