#!/usr/bin/env bash
# Make this checkout runnable on a fresh Debian 12 machine: Debian packages (as root, only the
# missing ones), uv, and the one workspace environment from uv.lock. Idempotent and quick when
# everything is already there.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

missing=()
while read -r pkg; do
  [[ -z "$pkg" || "$pkg" == \#* ]] && continue
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done < "$here/scripts/apt-packages.txt"
if ((${#missing[@]})); then
  if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "bootstrap: missing Debian packages (install them as root): ${missing[*]}" >&2
  fi
fi

if ! python3 -m uv --version >/dev/null 2>&1; then
  echo "bootstrap: installing uv from PyPI"
  # Debian's own python3 refuses user installs into it (PEP 668); uv is a standalone tool
  python3 -m pip install -q --disable-pip-version-check "uv>=0.5" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages "uv>=0.5"
fi
cd "$here"
python3 -m uv sync --locked --all-packages --quiet
