"""memaudit's SuperLink: Flower's ``flower-superlink``, whose ServerApps are memaudit's only.

    python -m memaudit.federated.flower.superlink FLOWER-SUPERLINK-ARGUMENTS...

takes ``flower-superlink``'s arguments (`memaudit.federated.flower.deploy.superlink_args`) and
runs Flower 1.42's SuperLink in this process with ``--isolation process``, beside memaudit's
SuperExec (`memaudit.federated.flower.superexec`), a thread of this process that asks Flower's
runtime handlers on the SuperLink's own state (`memaudit.federated.flower.localruntime`) for
ServerApp tasks and runs each as a thread here too: a ServerApp's Grid calls those handlers, not
the runtime API over HTTP.

**Adversary:** anyone who reaches the SuperLink's address. Flower 1.42's open-source SuperLink
authenticates no account on its Control API, so they can ``flwr run`` an app of their own, and
Flower's SuperExec would start its ServerApp on this host: the host that holds the run
directory and the prepared data of every user. memaudit's SuperExec runs a ServerApp task only
when the run's FAB is memaudit's app (`memaudit.federated.flower.superexec.is_memaudit_app`),
and then runs this installation's ServerApp (`memaudit.flower_node.server_app`), never code
from the FAB; any other run ends failed with
`memaudit.federated.flower.superexec.REFUSED_SERVER` (also in the run's log), and nothing of
its FAB is installed, imported or run. The SuperNodes refuse such apps on their side too
(`memaudit.federated.flower.supernode`). Test:
``tests/federated/test_flower_deploy.py::test_a_foreign_app_is_refused_by_the_superlink``.

``--isolation`` is refused: this SuperLink's isolation is memaudit's SuperExec. A ServerApp
runs in this process (JAX and the run's server stages included), so one that brings the
interpreter down brings the SuperLink down with it; an exception ends its run only.

A SuperNode's ask for a message and the ServerApp's ask for replies are held here until there
is one to return, its objects all stored (`memaudit.federated.flower.longpoll`), and a
SuperNode's request skips the Control API's HTTP layers (`memaudit.federated.flower.leanhttp`).
"""

from __future__ import annotations

import sys

from memaudit.federated.flower import bundle, leanhttp
from memaudit.federated.flower.longpoll import install_superlink
from memaudit.federated.flower.superexec import beside


def main(argv: list[str] | None = None) -> int:
    # optional dependency: flwr (the flower extra)
    from flwr.superlink.cli.flower_superlink import flower_superlink

    install_superlink()
    bundle.install_superlink()
    leanhttp.install()
    return beside(flower_superlink, list(sys.argv[1:] if argv is None else argv), task="serverapp")


if __name__ == "__main__":
    raise SystemExit(main())
