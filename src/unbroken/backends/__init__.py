"""Where nodes come from: the interface (``base``), the rule both backends share about silent nodes
(``crowd``) and the local backend (``local/``). The Kubernetes backend, its sibling over ``base``,
lives with the rest of the Kubernetes side in ``unbroken.kubernetes.backend``."""
