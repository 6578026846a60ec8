"""Process supervision, one package for both places that run a job's ranks: the node agent (local
clusters) and ``unbroken run`` (a pod). ``torchrun`` starts a worker's torchrun (or forks it from a warm
spare) and names how it ended; ``warm_spare`` is the spare process (torch imported, waiting to become a
rank) and ``spare_pool`` keeps them; ``rank_watch`` sees a rank die through a pidfd; ``step_clock`` is
the one clock of a rank's step times, behind both the agent's reports and the in-pod hang watch."""
