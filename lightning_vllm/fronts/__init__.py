"""The front ends, side by side, each in its framework's words, on the core (``lightning_vllm.core``):

- ``lightning/``: PyTorch Lightning's, the callback ``VLLMWeightSync`` and what its hooks call: which trainer ranks
  take part in a push (``roles.py``, on ``ranks.py``'s status group and ``every_rank.py``'s exchange), pushes on a
  thread of their own (``background.py``), rollouts tagged with versions (``rollouts.py``), what a due push point
  does (``push_points.py``);
- ``torchrl/``: TorchRL's, ``VLLMUpdater`` (``updater.py``).

Their public names are ``lightning_vllm``'s own (``from lightning_vllm import VLLMWeightSync``).
"""
