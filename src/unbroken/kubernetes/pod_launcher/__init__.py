"""``unbroken run``: the launcher inside a Kubernetes pod, a drop-in for ``torchrun``.

A plain torchrun in a pod ends the pod's container when a rank fails, and the
operator recreates every pod of the job: a new sandbox, a scheduling pass,
``import torch``, a rendezvous, a checkpoint read (about 7 s on the test cluster,
minutes on a real one). ``unbroken run`` keeps the pods and restarts in place,
as the local agent does (agent/held.py, rank/rejoin.py):

- each pod runs its ranks under a node-local torchrun; the ranks form the job's
  process group themselves (``ctx.run``, train.py), so one pod's torchrun can end
  and start again while the others' ranks wait;
- when a rank fails, its pod's torchrun is replaced (by a warm spare: a torchrun
  that has imported torch already), the other pods' ranks leave the broken group
  and are held, and all of them re-form the group as the next *round*; the new
  ranks take the model and optimizer from their peers' memory (``keep_live``),
  so no step is lost;
- the rounds are agreed by a coordinator that the launcher of node rank 0 (the
  Master pod) serves on ``MASTER_PORT + 1`` (coordinator.py); each launcher holds
  one TCP connection to it (member.py);
- when a round cannot be made (a pod lost with its node, ranks that do not leave,
  more than ``--max-restarts`` rounds), every launcher exits 1 and the operator
  restarts the job by recreating its pods, as for plain torchrun.

An in-place restart costs the API server nothing: no pod, job or Event is
written (the operator sees nothing but a short gap in the progress).
"""
