#!/usr/bin/env bash
# The network lab's system tools (scripts/bench/netns.py; Debian/Ubuntu; run as root or through sudo):
# iproute2 (ip, tc) for namespaces and shaped links, nftables for the NAT homes. Does nothing when all are there.
set -euo pipefail
missing=()
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
command -v nft >/dev/null || missing+=(nftables)
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_lab.sh: ip, tc and nft already installed"
  exit 0
fi
SUDO=""
[[ "$(id -u)" -ne 0 ]] && SUDO="sudo"
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "${missing[@]}"
nft --version
