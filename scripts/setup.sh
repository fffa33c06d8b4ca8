#!/usr/bin/env bash
# Install what the project needs on a fresh Debian machine (run as root; idempotent):
# system packages from apt (only the missing ones), then a .venv in the checkout with the project
# and its extras. It changes nothing else: no service is enabled, disabled, started or stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# lintian: tests/test_ops_deb.py checks the package with it (it ran only where someone had
# installed it). qemu-user-static: `fog-agent testbed arm64`, the arm64 benchmark (not in the suite;
# docs/operations.md, "arm64"); where systemd is PID 1 its package registers qemu's binfmt_misc entries.
APT_PACKAGES=(mosquitto mosquitto-clients libsystemd-dev pkg-config iproute2 systemd
              openjdk-17-jre-headless python3-venv python3-psutil python3-cryptography python3-systemd openssl gcc libc6-dev
              systemd-container debootstrap openssh-client lintian qemu-user-static)
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
# The agent's runtime dependencies first, the versions and wheels the .deb ships, each checked
# against its sha256 (packaging/requirements.lock; regenerate with packaging/lock.sh): the project
# install below then finds them satisfied. psutil and the extras (test, analytics, Ansible tools)
# are not locked: they never reach a fog node.
echo "setup: installing the locked runtime dependencies (pip --require-hashes)"
.venv/bin/python -m pip install -q --require-hashes --no-deps --only-binary=:all: -r packaging/requirements.lock
# The lab (lab/: simulators, checkers, benchmarks, demo, chaos, testbed; never on a node) is a
# distribution of its own; both editable, in one resolution.
echo "setup: installing fog-agent[dev,analytics,systemd,ops,fast] and fog-agent-lab (lab/) into .venv"
.venv/bin/python -m pip install -q -e '.[dev,analytics,systemd,ops,fast]' -e ./lab

# The container testbed's Debian root (debootstrap, about 3 minutes and 350 MB, once per machine;
# cached in ~/.cache/fog-agent/testbed/roots or $FOG_TESTBED_CACHE): built here, so that the
# suite's testbed test does not spend its time budget on it. Where containers cannot run, or the
# mirror cannot be reached, one line and setup goes on (the test builds or skips it then).
if [ "$(id -u)" -eq 0 ] && command -v systemd-nspawn >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
  echo "setup: the testbed's Debian root (built once, then reused)"
  .venv/bin/python -m agent testbed root || echo "setup: no testbed root now (see above); tests/test_testbed.py builds it when it runs"
else
  echo "setup: no testbed root: it needs root, systemd-nspawn and debootstrap"
fi
echo "setup: done"
