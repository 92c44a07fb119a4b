#!/usr/bin/env bash
# Debian's headless Chromium for the report's browser check (no browser download of its own).
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
  else
    echo "install Chromium so /usr/bin/chromium exists, then re-run" >&2
    exit 1
  fi
fi
