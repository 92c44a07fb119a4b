"""The federated program on Flower (``federated.runtime: flower``, issue 17).

`partition` splits a traced round at its federated primitives into client and server stages
(client stages exported with ``jax.export``); `execute` runs a partitioned round, the server's
stages in this process and the client stages on the nodes; `apps` holds the Flower
``ServerApp`` and ``ClientApp`` (Message API); `deploy` starts and submits to a SuperLink.
Nothing here imports ``flwr`` at module level, so the in-JAX runtime never needs it.

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX".
"""
