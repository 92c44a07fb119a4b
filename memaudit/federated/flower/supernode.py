"""memaudit's SuperNode: Flower's ``flower-supernode``, with memaudit's SuperExec and a short poll.

    python -m memaudit.federated.flower.supernode [--poll S] [--fleet bundled|flower] FLOWER-SUPERNODE-ARGUMENTS...

takes ``flower-supernode``'s arguments (`memaudit.federated.flower.deploy.supernode_args`) and
runs Flower 1.42's SuperNode in this process with three changes, each for the node's operator to
choose and none trusting the server:

- **memaudit's SuperExec** (`memaudit.federated.flower.superexec`): the SuperNode runs with
  ``--isolation process`` and memaudit's SuperExec runs beside it as a thread of this process,
  asking Flower's runtime handlers on the SuperNode's own state
  (`memaudit.federated.flower.transport.localruntime`) rather than its runtime API over HTTP. It runs
  memaudit's ClientApp from this installation and refuses any other app. The runtime API still
  listens (``--host``/``--port``), with a SuperExec secret no one holds
  (`memaudit.federated.flower.superexec.runtime_secret`): it hands no task to anyone outside
  this process; memaudit's SuperExec does not use it.
- **polls, not waits**: a SuperNode that finds no message waits 3 s before asking the SuperLink
  again, looks for its ClientApp's reply every 0.5 s, and asks again for an object of a message
  that is not there yet after 1 s, 2 s, 4 s (hard-coded in Flower 1.42), so every exchange of a
  round waits for the slowest node's next ask and its backoffs. Here the loop's wait before it
  asks the SuperLink again is at most ``--poll`` seconds (default
  `memaudit.federated.flower.transport.polls.SUPERNODE_POLL_S`: an idle node asks the SuperLink about
  1/poll times a second), it looks for its ClientApp's reply every 0.01 s (its own memory), and
  an object is asked for again after 0.02 s (`memaudit.federated.flower.transport.polls`). Its SuperExec's
  ask for a task is held until the node has pulled a message and all its objects
  (`memaudit.federated.flower.transport.longpoll`), and the loop asks again at once after an ask that
  memaudit's SuperLink held.

- **a message in one request each way** (`memaudit.federated.flower.transport.bundle`): against memaudit's
  SuperLink the node pulls a message with its objects, and pushes its reply with its objects, in
  one Fleet request each, not nine; against a SuperLink without those routes it makes Flower's
  requests. ``--fleet flower`` makes Flower's requests always (a proxy that passes only
  Flower's routes).

``--isolation`` and ``--superexec-auth-secret-file`` are refused: this SuperNode's isolation is
memaudit's SuperExec, and it makes its own secret. Flower's own
``flower-supernode`` still works with memaudit's apps (a ``flwr-clientapp`` per message), slower
and running whatever app a run brings.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    ap.add_argument("--poll", type=float, default=None,
                    help="seconds a SuperNode with no message waits before asking again (default: "
                         "memaudit.federated.flower.transport.polls.SUPERNODE_POLL_S)")
    ap.add_argument("--fleet", default="bundled",
                    help="bundled: a message and its reply in one request each where the SuperLink "
                         "serves that (memaudit's); flower: Flower's nine requests a message")
    ap.add_argument("--transport-off", action="append", default=[], metavar="LAYER",
                    help="leave out a layer of memaudit's Flower transport (memaudit.federated.flower."
                         "transport.OPTIONAL; the benchmark's comparison)")
    ours, flower_args = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.poll is not None and not 0.01 <= ours.poll <= 3.0:
        print(f"memaudit: error: --poll {ours.poll:g} is outside 0.01-3 s; give a poll in that range",
              file=sys.stderr)
        return 2
    if ours.fleet not in ("bundled", "flower"):
        print(f"memaudit: error: --fleet {ours.fleet!r} is not a way to talk to the SuperLink; give "
              "bundled or flower", file=sys.stderr)
        return 2
    off = [*ours.transport_off, *(["bundled"] if ours.fleet == "flower" else [])]
    try:
        # lazy: the transport checks the installed Flower before anything of Flower's is imported
        from memaudit.federated.flower import transport

        transport.install("supernode", off=off, poll=ours.poll)
    except ValueError as e:  # no Flower, not the version memaudit pins, or an unknown layer
        print(f"memaudit: error: {e}", file=sys.stderr)
        return 2
    # lazy, as the transport: after its version check
    from flwr.supernode.cli.flower_supernode import flower_supernode

    from memaudit.federated.flower.superexec import beside

    return beside(flower_supernode, flower_args, task="clientapp")


if __name__ == "__main__":
    raise SystemExit(main())
