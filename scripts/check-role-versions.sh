#!/usr/bin/env bash
# Version-driven install of the fog_agent role (fog_agent_deb_dir + fog_agent_version), for real
# with dpkg and apt, in a private container: a copy of the testbed's cached Debian root
# (`fog-agent testbed root`), booted without systemd and without a network (systemd-nspawn
# --private-network), the project's venv and checkout bind-mounted read-only, Ansible run inside
# against the container itself. Checks: install, second run changed=0, upgrade, downgrade
# (rollback = a lower fog_agent_version), each converging; a manual `apt-get install` of a version
# then leaves `--check` and a real run at changed=0 for that version.
#
# Usage (root): scripts/check-role-versions.sh DEB [WORKDIR]   (DEB: packaging/build-deb.sh's;
# two relabelled copies of it, VERSION+a and VERSION+b, are the versions; about 3 minutes)
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$(cd "${VENV:-$HERE/.venv}" && pwd)"
DEB="$(readlink -f "${1:?usage: check-role-versions.sh DEB [WORKDIR]}")"
WORK="${2:-$(mktemp -d /tmp/fog-role-versions.XXXXXX)}"
CACHED="${FOG_TESTBED_CACHE:-$HOME/.cache/fog-agent/testbed}/roots/bookworm-amd64"
[ -d "$CACHED" ] || { echo "no cached root $CACHED: run fog-agent testbed root"; exit 2; }
BASE="$(PYTHONPATH="$HERE" "$VENV/bin/python" -c 'import agent; print(agent.__version__)')"
rm -rf "$WORK/root"; mkdir -p "$WORK/debs"
cp -a "$CACHED" "$WORK/root"
PYTHONPATH="$HERE" "$VENV/bin/python" - "$DEB" "$WORK" "$BASE" <<'PY'
import shutil, sys
from pathlib import Path
from foglab.tools.testbed_upgrade import relabel_deb
deb, work, base = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
for v in (f"{base}+a", f"{base}+b"):
    shutil.copy(relabel_deb(deb, v, work / f"relabel-{v}"), work / "debs")
PY
cat > "$WORK/debs/inventory.yml" <<INV
all:
  hosts:
    node1:
      ansible_connection: local
      ansible_python_interpreter: /usr/bin/python3
      fog_agent_install_method: deb
      fog_agent_deb_dir: $WORK/debs
      fog_agent_install_packages: false
      fog_agent_manage_service: false
      fog_agent_metrics_port: 0
INV
printf -- '- hosts: all\n  gather_facts: false\n  roles: [fog_agent]\n' > "$WORK/debs/play.yml"
PYHOME="$(dirname "$(dirname "$(readlink -f "$VENV/bin/python")")")"
inside() {
  systemd-nspawn --register=no --keep-unit --private-network -q -D "$WORK/root" --bind-ro="$PYHOME" \
    --bind-ro="$VENV" --bind-ro="$HERE" --bind="$WORK/debs" /bin/sh -c "$1" 2>&1 | tr -d '\r' \
    | { grep -v 'propagate/root' || true; }
}
fail=0
step() {  # step NAME WANT-CHANGED WANT-VERSION ansible-playbook args
  local name="$1" want="$2" version="$3"; shift 3
  inside "cd $HERE/ansible && ANSIBLE_NOCOLOR=1 ANSIBLE_GATHERING=explicit ANSIBLE_ROLES_PATH=$HERE/ansible/roles \
    $VENV/bin/ansible-playbook -i $WORK/debs/inventory.yml $WORK/debs/play.yml $*; \
    dpkg-query -W -f='installed=\${Version}\n' fog-agent; echo venv=\$(readlink /opt/fog-agent/venv)" > "$WORK/$name.log"
  local changed got venv
  changed="$(grep -o 'changed=[0-9]*' "$WORK/$name.log" | head -1 | cut -d= -f2)"
  got="$(sed -n 's/^installed=//p' "$WORK/$name.log")"; venv="$(sed -n 's/^venv=//p' "$WORK/$name.log")"
  if grep -q 'failed=0' "$WORK/$name.log" && [ "$got" = "$version" ] && [ "$venv" = "venvs/$version" ] \
     && { [ "$want" = any ] || [ "$changed" = "$want" ]; }; then
    echo "ok    $name: changed=$changed, $got, $venv"
  else
    echo "FAIL  $name: changed=$changed (want $want), installed $got, $venv (want $version), see $WORK/$name.log"; fail=1
  fi
}
step install        any "$BASE+a" -e fog_agent_version="$BASE+a"
step again          0   "$BASE+a" -e fog_agent_version="$BASE+a"
step upgrade        any "$BASE+b" -e fog_agent_version="$BASE+b"
step rollback       any "$BASE+a" -e fog_agent_version="$BASE+a"
step rollback-again 0   "$BASE+a" -e fog_agent_version="$BASE+a"
inside "DEBIAN_FRONTEND=noninteractive apt-get install -y $WORK/debs/fog-agent_$BASE+b_all.deb >/dev/null 2>&1; rm -f /var/cache/fog-agent/*.deb"
step manual-check   0   "$BASE+b" --check --diff -e fog_agent_version="$BASE+b"
step manual-run     0   "$BASE+b" -e fog_agent_version="$BASE+b"
echo "logs in $WORK (the container root: $WORK/root)"
exit $fail
