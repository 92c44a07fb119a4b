"""memaudit's SuperNode: Flower's ``flower-supernode``, with memaudit's SuperExec and a short poll.

    python -m memaudit.federated.flower.supernode [--poll S] FLOWER-SUPERNODE-ARGUMENTS...

takes ``flower-supernode``'s arguments (`memaudit.federated.flower.deploy.supernode_args`) and
runs Flower 1.42's SuperNode in this process with two changes, both for the node's operator to
choose and neither trusting the server:

- **memaudit's SuperExec** (`memaudit.federated.flower.superexec`): the SuperNode runs with
  ``--isolation process`` and this process starts memaudit's SuperExec beside it, on the
  SuperNode's runtime API (``--host``/``--port``; TLS when ``--ssl-ca-certfile`` is given). It
  runs memaudit's ClientApp from this installation in one long-lived process and refuses any
  other app.
- **the poll**: a SuperNode that finds no message waits 3 s before asking the SuperLink again
  (hard-coded in Flower 1.42's ``start_client_internal``), so every exchange of a round waits for
  the slowest node's next ask. Here it waits ``--poll`` seconds (default `POLL_S`): each node
  asks the SuperLink about 1/poll times a second while idle. Only that wait changes (`IdleWait`).

``--isolation`` is refused: this SuperNode's isolation is memaudit's SuperExec. Flower's own
``flower-supernode`` still works with memaudit's apps (a ``flwr-clientapp`` per message), slower
and running whatever app a run brings.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from memaudit.errors import ConfigError

POLL_S = 0.1
FLOWER_IDLE_WAIT_S = 3  # Flower 1.42's wait after an ask that found no message
RUNTIME_HOST, RUNTIME_PORT = "127.0.0.1", 9094  # flower-supernode's defaults for the runtime API


class IdleWait:
    """``time`` as Flower's SuperNode loop sees it: its wait after an empty ask is `poll` seconds;
    every other call is the ``time`` module's.

    >>> w = IdleWait(0.0)
    >>> t = time.monotonic(); w.sleep(FLOWER_IDLE_WAIT_S); time.monotonic() - t < 1.0
    True
    >>> w.monotonic is time.monotonic
    True
    """

    def __init__(self, poll: float) -> None:
        self.poll = float(poll)

    def sleep(self, seconds: float) -> None:
        time.sleep(self.poll if seconds == FLOWER_IDLE_WAIT_S else seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def shorten_poll(poll: float) -> None:
    """Make Flower's SuperNode loop (in this process) wait `poll` s after an empty ask."""
    # optional dependency: flwr (the flower extra); this module runs only on a SuperNode
    from flwr.supernode import start_client_internal as loop

    if getattr(loop, "time", None) is not time and not isinstance(getattr(loop, "time", None), IdleWait):
        raise ConfigError("this Flower's SuperNode loop does not wait through the time module; "
                          "run flower-supernode itself, or the Flower version memaudit pins")
    loop.time = IdleWait(poll)


def _value(args: list[str], flag: str, default: str | None) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def superexec_command(flower_args: list[str], parent_pid: int) -> list[str]:
    """memaudit's SuperExec for the SuperNode these arguments start: on its runtime API, with the
    runtime API's CA certificate when it serves TLS.

    >>> superexec_command(["--port", "9100", "--insecure"], 7)[3:]
    ['--runtime-api-address', '127.0.0.1:9100', '--parent-pid', '7']
    """
    host = _value(flower_args, "--host", RUNTIME_HOST) or RUNTIME_HOST
    host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    host = f"[{host}]" if ":" in host else host
    port = _value(flower_args, "--port", str(RUNTIME_PORT))
    cmd = [sys.executable, "-m", "memaudit.federated.flower.superexec",
           "--runtime-api-address", f"{host}:{port}", "--parent-pid", str(parent_pid)]
    ca = _value(flower_args, "--ssl-ca-certfile", None)
    return cmd + (["--root-certificates", ca] if ca else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    ap.add_argument("--poll", type=float, default=POLL_S,
                    help="seconds a SuperNode with no message waits before asking again")
    ours, flower_args = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if _value(flower_args, "--isolation", None) is not None:
        print("memaudit: error: --isolation is memaudit's SuperExec on this SuperNode; remove it, "
              "or run flower-supernode itself", file=sys.stderr)
        return 2
    if not 0.01 <= ours.poll <= 3.0:
        print(f"memaudit: error: --poll {ours.poll:g} is outside 0.01-3 s; give a poll in that range",
              file=sys.stderr)
        return 2
    # optional dependency: flwr (the flower extra)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    try:
        shorten_poll(ours.poll)
    except ConfigError as e:
        print(f"memaudit: error: {e}", file=sys.stderr)
        return 2
    # same process group as this SuperNode: stopping the node's group stops its SuperExec too
    subprocess.Popen(superexec_command(flower_args, os.getpid()), stdin=subprocess.DEVNULL)
    sys.argv = ["flower-supernode", *flower_args, "--isolation", "process"]
    flower_supernode()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
