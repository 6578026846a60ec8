"""Kernel-log monitoring: node-problem-detector rule files, NVIDIA's Xid table, and log sources."""
