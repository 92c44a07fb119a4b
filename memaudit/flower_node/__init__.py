"""The module a Flower App built by memaudit before its run wing names (``from memaudit.flower_node
import client_app, server_app``): such an App, already installed on a SuperLink or SuperNode, still
loads. memaudit's apps are `memaudit.federated.flower.node`'s; new Apps import them from there
(`memaudit.federated.flower.deploy.write_app`). Imports no JAX, as that module.
"""

from memaudit.federated.flower.node import client_app, server_app

__all__ = ["client_app", "server_app"]
