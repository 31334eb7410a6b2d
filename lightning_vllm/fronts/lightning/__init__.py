"""The Lightning front end: the callback (``callback.py``) and what its hooks call.

- ``ranks.py``: the trainer's ranks and their status group;
- ``roles.py``: how the ranks push a sharded policy, side by side: gathered in lockstep (rank 0 sending), or every rank
  sending its own share (a policy every rank holds whole is pushed by rank 0 alone);
- ``every_rank.py``: the exchange of a push every rank sends its own shard of (``push_from="every_rank"``);
- ``background.py``: pushes on a thread of their own, from snapshots (``blocking=False``);
- ``rollouts.py``: sampling from the engines inside ``training_step``, tagged with versions;
- ``push_points.py``: what a due push point does, in the Lightning callback's words.
"""
