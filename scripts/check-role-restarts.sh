#!/usr/bin/env bash
# Run the fog_agent role alone, with service management on, against a stand-in `systemctl` that
# logs its calls and keeps the unit's state, and check that each kind of change costs the agent
# what docs/operations.md ("One restart per change") says: a fresh install one start, a log level
# change one reload, any other change one restart (a reload notified in the same run is skipped),
# no change nothing. Everything goes to a temporary prefix; no real unit is touched.
#
# Usage: scripts/check-role-restarts.sh [WORKDIR]      (about 2 minutes; not in the test suite)
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$HERE/.venv}"
WORK="${1:-$(mktemp -d /tmp/fog-role-restarts.XXXXXX)}"
mkdir -p "$WORK/bin" "$WORK/state"
cat > "$WORK/bin/systemctl" <<STUB
#!/bin/bash
S="$WORK/state"; echo "\$*" >> "$WORK/calls.log"
args=(); for a in "\$@"; do case "\$a" in -*) ;; *) args+=("\$a") ;; esac; done
active=\$(cat \$S/active 2>/dev/null || echo inactive); en=\$(cat \$S/enabled 2>/dev/null || echo disabled)
case "\${args[0]}" in
  show) printf 'Id=fog-agent.service\nLoadState=loaded\nActiveState=%s\nSubState=%s\nUnitFileState=%s\n' \
          "\$active" "\$([ "\$active" = active ] && echo running || echo dead)" "\$en" ;;
  is-enabled) echo "\$en"; [ "\$en" = enabled ] ;;
  is-active) echo "\$active"; [ "\$active" = active ] ;;
  start|restart) echo active > \$S/active ;;
  stop) echo inactive > \$S/active ;;
  enable) echo enabled > \$S/enabled ;;
  disable) echo disabled > \$S/enabled ;;
esac
exit 0
STUB
chmod +x "$WORK/bin/systemctl"
PYTHON="$VENV/bin/python" bash "$HERE/packaging/build-wheelhouse.sh" "$WORK/wheelhouse" >/dev/null
cat > "$WORK/inventory.yml" <<INV
all:
  hosts:
    n1:
      ansible_connection: local
      ansible_python_interpreter: $VENV/bin/python
      fog_agent_prefix: $WORK/prefix
      fog_agent_install_packages: false
      fog_agent_manage_user: false
      fog_agent_user: root
      fog_agent_group: root
      fog_agent_manage_service: true
      fog_agent_python: /usr/bin/python3
      fog_agent_wheelhouse_src: $WORK/wheelhouse
      fog_agent_metrics_port: 0
INV
printf -- '- hosts: all\n  gather_facts: false\n  roles: [fog_agent]\n' > "$WORK/play.yml"
export PATH="$WORK/bin:$PATH" ANSIBLE_ROLES_PATH="$HERE/ansible/roles" ANSIBLE_GATHERING=explicit ANSIBLE_PIPELINING=1
fail=0
step() {  # step NAME EXPECTED-CALLS ansible-playbook-args...
  local name="$1" want="$2"; shift 2
  : > "$WORK/calls.log"
  "$VENV/bin/ansible-playbook" -i "$WORK/inventory.yml" "$WORK/play.yml" "$@" > "$WORK/$name.log" 2>&1 \
    || { echo "$name: ansible-playbook failed, see $WORK/$name.log"; fail=1; return; }
  local got; got="$(grep -E '^(start|restart|reload|stop) ' "$WORK/calls.log" | tr '\n' ';' || true)"
  if [ "$got" = "$want" ]; then echo "ok    $name: ${got:-no call}"; else echo "FAIL  $name: want '${want}' got '${got}'"; fail=1; fi
}
step fresh-install   "start fog-agent.service;"
step log-level       "reload fog-agent.service;"   -e fog_agent_log_level=debug
step level-and-slots "restart fog-agent.service;"  -e fog_agent_log_level=info -e fog_agent_slots=3
step level-and-pass  "restart fog-agent.service;"  -e fog_agent_log_level=debug -e fog_agent_slots=3 -e fog_agent_mqtt_password=secret-2
step no-change       ""                            -e fog_agent_log_level=debug -e fog_agent_slots=3 -e fog_agent_mqtt_password=secret-2
echo "logs in $WORK"
exit $fail
