#!/usr/bin/env bash
# Headless Chromium for tests/test_monitor.py's page test (Debian/Ubuntu; run as root or through sudo).
# Does nothing when /usr/bin/chromium is already there.
set -euo pipefail
if [[ -x /usr/bin/chromium ]]; then
  echo "install_browser.sh: $(/usr/bin/chromium --version 2>/dev/null || echo chromium) already installed"
  exit 0
fi
SUDO=""
[[ "$(id -u)" -ne 0 ]] && SUDO="sudo"
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium
/usr/bin/chromium --version
