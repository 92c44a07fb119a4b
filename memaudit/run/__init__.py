"""The run wing: everything above the training mechanics that turns a config into a run.

`dispatch` picks the backend (after `checks.check_before_disk`); each backend's entry sets up
its trainer (`centralized`: torch in one process; `launch`: the data x tensor-parallel grid's
processes; `centralized_jax`: the centralized backend's JAX engine; `federated`: the JAX backend
in this process; `flower`: a run submitted to a Flower federation, and the ServerApp's side of
it) and trains it through the one driver (`driver.fit`) inside the one run lifecycle
(`lifecycle.RunSession`). The mechanics below (`train/`, `parallel/`, `federated/`, `models/`,
`privacy/`, `data/`, `probes/`) never import this package (`tests/test_import_graph.py`).
"""
