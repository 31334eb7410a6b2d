"""The core: one push, end to end, and what it commits.

- ``versions.py``: ``WeightVersions``, the one owner of the trainer's versions, and the handles a
  push point moves them through;
- ``connection.py``: one engine's connection: the checks before any byte moves, the transfer
  group, a push;
- ``after_failure.py``: what a failed ``nccl``/``ipc`` push leaves open on an engine, ended before
  the next connection;
- ``engine_set.py``: the engines of one updater by index, and a push sent to each;
- ``payloads.py``: what a push carries, chosen once;
- ``updater.py``: the updater that ties them.

Nothing here imports the plans (ranks, background pushes, rollouts) or the front ends (the
Lightning callback, TorchRL's surface), which are built on it.
"""
