"""The collective bandwidth sweep: nccl-tests' numbers, from torch.distributed (NCCL on GPU, gloo on CPU).

- ``sweep``   pure: sizes, algbw/busbw formulas, the nccl-tests table
- ``worker``  one rank: times each collective at each size
- ``launch``  starts one worker per node (in the node's network namespace) and collects rank 0's report
- ``check``   the catalogue check: floor, retry, and which node is slow
"""
