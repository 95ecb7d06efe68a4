"""kog_dist: latency-first batch-1 decoding of Laneformer models. `kog_dist.Client` talks to a server."""


def __getattr__(name):
    if name == "Client":   # on first use: `import kog_dist` must not load zmq (tests/test_control_cli.py)
        from .client import Client
        return Client
    raise AttributeError(f"module 'kog_dist' has no attribute {name!r}")
