"""The controller: a job reconciler and a node reconciler over the store."""
