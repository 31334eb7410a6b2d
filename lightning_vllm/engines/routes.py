"""What ``HTTPEngine`` and the server middleware of ``lightning_vllm.server`` agree on: a route and a
header that ``vllm serve`` does not have until the middleware adds them."""

PAUSE_LEASE_HEADER = "x-lightning-vllm-pause-lease"
"""The header with which ``HTTPEngine`` asks for a pause that ends by itself (``server.PauseLease``)."""

ADAPTER_ROUTE = "/lightning_vllm/adapter"
"""The route of ``server.PushedAdapters``: ``GET`` tells it is there, ``POST {"name", "id", "key"}``
serves an adapter."""
