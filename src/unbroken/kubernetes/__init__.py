"""The Kubernetes side, in one home: the backend (``backend/``: the ClusterStore and Backend seams on
the API server), and the three processes that run on a cluster over it: the operator
(``operator/``, a Deployment), the node agent (``node_agent``, a DaemonSet) and ``unbroken run``
(``pod_launcher/``, torchrun's drop-in inside a job's pods). The processes reach the backend through
``runtime.KubernetesRuntime``. The CLI's Kubernetes commands live with the CLI (``cli/k8s.py``).

It is not under ``backends/``: the processes import the controller and the runtime, which sit above
the backends in the layers (pyproject.toml's import contracts), so a package holding both would import
upward. The backend itself is the local backend's sibling over ``backends.base``."""
