"""Plans: which trainer ranks take part in a push, and when training may go on.

- ``ranks.py``: the trainer's ranks and their status group; a sharded policy gathered in
  lockstep, rank 0 sending;
- ``every_rank.py``: a push every rank sends its own shard of (``push_from="every_rank"``);
- ``background.py``: pushes on a thread of their own, from snapshots (``blocking=False``);
- ``rollouts.py``: sampling from the engines inside ``training_step``, tagged with versions;
- ``push_points.py``: what a due push point does, in the Lightning callback's words.

Built on the core (``lightning_vllm.core``); the front ends build on them.
"""
