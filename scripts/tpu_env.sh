#!/bin/bash
# Sourced on a lent TPU machine (`. scripts/tpu_env.sh`, carry: [".whl-tpu"] on a machine's first
# call): installs once what the host lacks (memaudit's own dependencies from the carried wheels,
# torch's CPU build from the host's /opt/wheels, matplotlib from its index; docs/accelerators.md)
# into /tmp, which stays between the machine's commands, and puts them and this checkout on
# PYTHONPATH. Returns 9 when the carried wheels cannot be installed.
t_env=$(date +%s)
if [ ! -f /tmp/site/.done ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || return 9
  touch /tmp/site/.done
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --index-url file:///opt/pypi/simple --find-links /opt/wheels --target /tmp/site3 \
    torch==2.13.0 || echo "torch: not installed"
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site2 \
    matplotlib pillow fonttools kiwisolver contourpy || echo "matplotlib: not installed"
  echo "install $(( $(date +%s) - t_env )) s"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/site:/tmp/site3:/tmp/site2
