"""Cluster and job files: pydantic models and loading with clear errors."""

from unbroken.config.cluster import ClusterConfig, InstanceGroup, LocalSettings
from unbroken.config.job import CheckpointSpec, JobSpec, ResilienceSpec, RestartPolicy
from unbroken.config.loading import load_model

__all__ = [
    "CheckpointSpec",
    "ClusterConfig",
    "InstanceGroup",
    "JobSpec",
    "LocalSettings",
    "ResilienceSpec",
    "RestartPolicy",
    "load_model",
]
