"""The Kubernetes backend: the ClusterStore and Backend seams mapped onto a Kubernetes API.

- :mod:`.names`: every label, annotation, taint and condition unbroken reads or writes;
- :mod:`.client`: an API client from a kubeconfig/context or the pod's service account;
- :mod:`.annotations`: a job's ``unbroken.dev/*`` annotations, validated;
- :mod:`.workloads`: PyTorchJob (kubeflow.org/v1) and TrainJob (trainer.kubeflow.org/v1alpha1);
- :mod:`.store`: :class:`~unbroken.state.store.ClusterStore` on Nodes, workload annotations, Events, Leases;
- :mod:`.backend`: :class:`~unbroken.backends.base.Backend` on the workloads' pods and a ``Remediator``.

The operator process (:mod:`unbroken.kubernetes.operator`) runs the same reconcilers as the
local controller over these two.
"""
