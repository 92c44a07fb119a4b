#!/bin/bash
# Sourced on a lent TPU machine (`. scripts/tpu_env.sh`, carry: [".whl-tpu"] on a machine's first
# call): installs once what the host lacks (memaudit's own dependencies from the carried wheels,
# torch's CPU build from the host's /opt/wheels, matplotlib and its dependencies from its index;
# docs/accelerators.md) into /tmp, which stays between the machine's commands, and puts them and
# this checkout on PYTHONPATH. Returns 9 when the carried wheels cannot be installed.
t_env=$(date +%s)
_pip() { PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile \
  --no-cache-dir "$@"; }
if [ ! -f /tmp/site/.done ]; then
  _pip --no-index --upgrade --target /tmp/site .whl-tpu/*.whl || return 9
  touch /tmp/site/.done
fi
if [ ! -f /tmp/site3/.done ]; then
  _pip --only-binary=:all: --index-url file:///opt/pypi/simple --find-links /opt/wheels \
    --target /tmp/site3 torch==2.13.0 || echo "torch: not installed"
  mkdir -p /tmp/site3 && touch /tmp/site3/.done
fi
if [ ! -f /tmp/site2/.done ]; then
  # one package a call: one the index lacks (the host may have it) does not stop the others
  for p in matplotlib pillow fonttools kiwisolver contourpy cycler pyparsing python-dateutil six \
      packaging; do
    python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$p" 2>/dev/null && continue
    _pip --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site2 "$p" \
      || echo "$p: not installed"
  done
  mkdir -p /tmp/site2 && touch /tmp/site2/.done
fi
[ "$(( $(date +%s) - t_env ))" -gt 2 ] && echo "install $(( $(date +%s) - t_env )) s"
export PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/site:/tmp/site3:/tmp/site2
