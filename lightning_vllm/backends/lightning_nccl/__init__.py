"""``lightning_nccl``: vLLM's packed NCCL broadcast into workers that stage a push and commit it whole
(``worker.py``), sent by vLLM's own NCCL trainer engine (``backend.py``)."""
