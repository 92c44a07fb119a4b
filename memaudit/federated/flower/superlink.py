"""memaudit's SuperLink: Flower's ``flower-superlink``, whose ServerApps are memaudit's only.

    python -m memaudit.federated.flower.superlink [--server-key serverapp.key] FLOWER-SUPERLINK-ARGUMENTS...

takes ``flower-superlink``'s arguments (`memaudit.federated.flower.deploy.superlink_args`) and
runs Flower 1.42's SuperLink in this process with ``--isolation process``, beside memaudit's
SuperExec (`memaudit.federated.flower.superexec`), a thread of this process that asks Flower's
runtime handlers on the SuperLink's own state (`memaudit.federated.flower.transport.localruntime`) for
ServerApp tasks and runs each as a thread here too: a ServerApp's Grid calls those handlers, not
the runtime API over HTTP.

**Adversary:** anyone who reaches the SuperLink's address. Flower 1.42's open-source SuperLink
authenticates no account on its Control API, so they can ``flwr run`` an app of their own, and
Flower's SuperExec would start its ServerApp on this host: the host that holds the run
directory and the prepared data of every user. memaudit's SuperExec runs a ServerApp task only
when the run's FAB is memaudit's app (`memaudit.federated.flower.superexec.is_memaudit_app`),
and then runs this installation's ServerApp (`memaudit.federated.flower.node.server_app`), never code
from the FAB; any other run ends failed with
`memaudit.federated.flower.superexec.REFUSED_SERVER` (also in the run's log), and nothing of
its FAB is installed, imported or run. The SuperNodes refuse such apps on their side too
(`memaudit.federated.flower.supernode`). Test:
``tests/federated/test_flower_deploy.py::test_a_foreign_app_is_refused_by_the_superlink``.

**Adversary:** anyone who reaches the SuperLink's address and asks its runtime API for a run's
ServerApp task, to speak for the run to its nodes. Flower answers that ask only when it is
signed with a SuperExec secret, here one this process makes and no one holds
(`memaudit.federated.flower.superexec.runtime_secret`): every task goes to memaudit's SuperExec.
With ``--server-key`` (the ``serverapp.key`` written with the partitions) memaudit's ServerApp signs
every message it sends, once bound to its run, and nodes whose manifest names that key answer
nothing else (`memaudit.federated.flower.messages`). Tests:
``tests/federated/test_flower_deploy.py::test_nobody_takes_the_server_seat`` and
``::test_a_node_answers_only_its_runs_server``.

``--isolation`` and ``--superexec-auth-secret-file`` are refused: this SuperLink's isolation is
memaudit's SuperExec, and it makes its own secret. A ServerApp
runs in this process (JAX and the run's server stages included), so one that brings the
interpreter down brings the SuperLink down with it; an exception ends its run only.

A SuperNode's ask for a message and the ServerApp's ask for replies are held here until there
is one to return, its objects all stored (`memaudit.federated.flower.transport.longpoll`).
"""

from __future__ import annotations

import argparse
import sys

from memaudit.federated.flower.messages import use_server_key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    ap.add_argument("--server-key", default=None,
                    help="the serverapp.key written with the partitions: memaudit's ServerApp signs its "
                         "messages with it, and nodes whose manifest names it answer only those")
    ap.add_argument("--transport-off", action="append", default=[], metavar="LAYER",
                    help="leave out a layer of memaudit's Flower transport (memaudit.federated.flower."
                         "transport.OPTIONAL; the benchmark's comparison)")
    ours, flower_args = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.server_key is not None:
        try:
            use_server_key(ours.server_key)
        except ValueError as e:
            print(f"memaudit: error: {e}", file=sys.stderr)
            return 2
    try:
        # lazy: the transport checks the installed Flower before anything of Flower's is imported
        from memaudit.federated.flower import transport

        transport.install("superlink", off=ours.transport_off)
    except ValueError as e:  # no Flower, not the version memaudit pins, or an unknown layer
        print(f"memaudit: error: {e}", file=sys.stderr)
        return 2
    # lazy, as the transport: after its version check
    from flwr.superlink.cli.flower_superlink import flower_superlink

    from memaudit.federated.flower.superexec import beside

    return beside(flower_superlink, flower_args, task="serverapp")


if __name__ == "__main__":
    raise SystemExit(main())
