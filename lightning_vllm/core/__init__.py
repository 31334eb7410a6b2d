"""The core: one push, end to end, and what it commits.

- ``weight_sync.py``: ``WeightSync``, which owns the engines, the versions, the options and the
  post hooks, and knows no framework;
- ``push.py``: the engines by index, and one push to them as an object: prepared, then sent, which alone ends
  its version, and what it reports (``SyncStats``);
- ``landing_check.py``: after a push, what each engine holds held against what was sent, layer by layer;
- ``versions.py``: ``WeightVersions``, the one owner of the trainer's versions, and the handle a
  push point moves them through;
- ``payload_choice.py``: what a push carries, decided by a pure function of the weights, the options and the
  engines' facts (``facts.py``), then built for every rank alike;
- ``connection.py``: one engine's connection: the checks before any byte moves, the transfer
  group, a push;
- ``after_failure.py``: what a failed ``nccl``/``ipc`` push leaves open on an engine, ended before
  the next connection.

Nothing here imports the front ends (``fronts/``: the Lightning callback with its rank roles, background pushes and
rollouts; TorchRL's surface), which are built on it.
"""
