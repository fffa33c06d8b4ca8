#!/usr/bin/env bash
# Install what the project needs on a fresh Debian machine (run as root; idempotent):
# system packages from apt (only the missing ones), then a .venv in the checkout with the project
# and its extras. It changes nothing else: no service is enabled, disabled, started or stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

APT_PACKAGES=(mosquitto mosquitto-clients libsystemd-dev pkg-config iproute2 systemd
              openjdk-17-jre-headless python3-venv python3-psutil python3-systemd openssl gcc libc6-dev
              systemd-container debootstrap openssh-client)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# A JRE from elsewhere (e.g. a preinstalled JDK) is enough for PySpark.
if command -v java >/dev/null 2>&1; then
  missing=("${missing[@]/openjdk-17-jre-headless}")
fi
# python3-venv is only needed when the interpreter cannot create venvs by itself.
if "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# A system Mosquitto (installed here or before) is left as it is: the demo and the tests start
# private brokers on free loopback ports and never use port 1883.

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "setup: installing fog-agent[dev,analytics,systemd,ops,fast] into .venv"
.venv/bin/python -m pip install -q -e '.[dev,analytics,systemd,ops,fast]'
echo "setup: done"
