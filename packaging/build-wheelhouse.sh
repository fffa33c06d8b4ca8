#!/usr/bin/env bash
# Build the agent's wheel and collect the pure-Python wheels it depends on into one directory
# (a "wheelhouse"), so that a Pi installs offline: `pip install --no-index --find-links DIR fog-agent`.
#
# Usage: packaging/build-wheelhouse.sh OUTDIR
#
# The dependencies are exactly those of packaging/requirements.lock (versions and sha256 hashes,
# `pip download --require-hashes`; regenerate it with packaging/lock.sh), and OUTDIR gets a
# requirements.lock of its own: those lines plus the agent's wheel with its hash, which the .deb's
# postinst installs with `pip install --require-hashes --no-deps`.
# Only pure-Python dependencies are bundled (paho-mqtt, prometheus-client, tomli for Python < 3.11):
# psutil and cryptography, the compiled dependencies, come from Debian (python3-psutil and
# python3-cryptography, Depends of the .deb) and reach the venv through --system-site-packages. That keeps the wheelhouse, and the .deb, the same
# for arm64, armhf and amd64. Tooling: pip only (from the project venv or the system).
# Idempotent: if OUTDIR already holds the wheel built from the same sources, nothing is rebuilt.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PROJECT="$(cd "$HERE/.." && pwd)"
OUT="${1:?usage: build-wheelhouse.sh OUTDIR}"
PYTHON="${PYTHON:-$PROJECT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

VERSION="$("$PYTHON" -c 'import re,sys; print(re.search(r"__version__ = \"([^\"]+)\"", open(sys.argv[1]).read()).group(1))' "$PROJECT/agent/__init__.py")"
# The sources' digest, so that a rebuilt checkout with the same version number is not skipped.
LOCK="$HERE/requirements.lock"
SRC_HASH="$(cd "$PROJECT" && { find agent -name '*.py' -print; echo pyproject.toml; echo packaging/requirements.lock; } | LC_ALL=C sort \
  | xargs sha256sum | sha256sum | cut -d' ' -f1)"
mkdir -p "$OUT"
if ls "$OUT"/fog_agent-"$VERSION"-*.whl >/dev/null 2>&1 && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$SRC_HASH" ] \
   && [ -z "${FORCE:-}" ]; then
  echo "wheelhouse: $OUT already has fog-agent $VERSION from these sources"
  exit 0
fi
rm -f "$OUT"/*.whl "$OUT/.complete" "$OUT/requirements.lock"

# The project's wheel, built in pip's isolated build env (setuptools from the package index; the
# venv's own setuptools may be too old to build wheels without the `wheel` package).
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
cp -r "$PROJECT/pyproject.toml" "$PROJECT/README.md" "$PROJECT/agent" "$BUILD/"
find "$BUILD" -name __pycache__ -prune -exec rm -rf {} +
if ! "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$OUT" "$BUILD" >"$BUILD/pip-wheel.log" 2>&1 \
   || ! ls "$OUT"/fog_agent-"$VERSION"-py3-none-any.whl >/dev/null 2>&1; then
  cat "$BUILD/pip-wheel.log" >&2
  echo "wheelhouse: building the fog-agent wheel failed" >&2
  exit 1
fi

# Its pure-Python dependencies, as locked. Every wheel, whatever its marker says about the Python
# running this build (pip evaluates markers against it, not --python-version): tomli is for the
# nodes' Python < 3.11, and the install on the node applies the markers.
sed -E 's/ ;[^\\]*\\$/ \\/' "$LOCK" > "$BUILD/download.txt"
if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.9 --require-hashes \
     --dest "$OUT" -r "$BUILD/download.txt" >"$BUILD/pip-download.log" 2>&1; then
  cat "$BUILD/pip-download.log" >&2
  echo "wheelhouse: downloading the locked dependencies failed (a changed wheel fails its hash)" >&2
  exit 1
fi
for dist in paho_mqtt prometheus_client tomli; do
  ls "$OUT"/${dist}-*-py3-none-any.whl >/dev/null 2>&1 || { echo "wheelhouse: $dist wheel missing" >&2; exit 1; }
done
WHEEL="$(ls "$OUT"/fog_agent-"$VERSION"-py3-none-any.whl)"
{ grep -v '^#' "$LOCK"
  echo "fog-agent==$VERSION \\"
  echo "    --hash=sha256:$(sha256sum "$WHEEL" | cut -d' ' -f1)"
} > "$OUT/requirements.lock"
echo "$SRC_HASH" > "$OUT/.complete"
echo "wheelhouse: $OUT"
ls -1 "$OUT"
