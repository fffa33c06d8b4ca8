#!/usr/bin/env bash
# Build the fog-agent Debian package: wheels + units + default config, venv built at install time.
#
# Usage: packaging/build-deb.sh [--out DIR] [--wheelhouse DIR] [--arch all|arm64|amd64|armhf]
#                               [--maintainer "Name <address>"]
#
# The Maintainer (control file and changelog trailer) is --maintainer, else taken from the
# environment as Debian's own tools (dch, debchange) take it: "$DEBFULLNAME <$DEBEMAIL>", or
# DEBEMAIL alone when it already reads "Name <address>". Without either the build stops (exit 2):
# a package for your fleet names whoever answers for it, and a placeholder is what lintian flags.
#
# Why the venv is built by postinst rather than shipped: a venv holds absolute paths and
# interpreter-specific files, and building an arm64 venv on an amd64 machine is not possible
# natively. The package ships pure-Python wheels only (psutil comes from Debian's python3-psutil),
# so the default Architecture is `all`: the same .deb installs on a Pi (arm64/armhf) and on amd64.
# `--arch` only relabels the package for repositories that want per-arch files.
# Tooling: bash, pip (wheel + download), dpkg-deb (dpkg-dev not needed). No fakeroot:
# --root-owner-group makes every file root-owned in the archive.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PROJECT="$(cd "$HERE/.." && pwd)"
OUT="$PROJECT/dist"
WHEELHOUSE=""
ARCH=all
MAINTAINER=""
case "${DEBEMAIL:-}" in
  "") ;;
  *"<"*">") MAINTAINER="$DEBEMAIL" ;;
  *) [ -n "${DEBFULLNAME:-}" ] && MAINTAINER="$DEBFULLNAME <$DEBEMAIL>" ;;
esac
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
    --arch) ARCH="$2"; shift 2 ;;
    --maintainer) MAINTAINER="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "build-deb: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$ARCH" in all|arm64|amd64|armhf) ;; *) echo "build-deb: unsupported --arch $ARCH" >&2; exit 2 ;; esac
if [ -z "$MAINTAINER" ]; then
  echo "build-deb: who maintains this package? export DEBFULLNAME=\"Your Name\" DEBEMAIL=you@example.org" \
       "(as for dch), or pass --maintainer \"Name <address>\"" >&2
  exit 2
fi
case "$MAINTAINER" in *" <"*@*">") ;; *) echo "build-deb: --maintainer must look like 'Name <address>'" >&2; exit 2 ;; esac

PYTHON="${PYTHON:-$PROJECT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
VERSION="$("$PYTHON" -c 'import re,sys; print(re.search(r"__version__ = \"([^\"]+)\"", open(sys.argv[1]).read()).group(1))' "$PROJECT/agent/__init__.py")"

# The changelog's newest entry must be this version: a release without its entry is a mistake.
TOP="$(sed -n '1s/^fog-agent (\([^)]*\)).*/\1/p' "$HERE/deb/changelog")"
if [ "$TOP" != "$VERSION" ]; then
  echo "build-deb: packaging/deb/changelog starts with $TOP, agent/__init__.py says $VERSION: add an entry" >&2
  exit 2
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [ -z "$WHEELHOUSE" ]; then
  WHEELHOUSE="$WORK/wheelhouse"
fi
"$HERE/build-wheelhouse.sh" "$WHEELHOUSE" >/dev/null

STAGE="$WORK/fog-agent_${VERSION}_${ARCH}"
# The wheels are architecture-independent data: /usr/share (nothing of the package is in /opt;
# the venvs postinst builds from them are, see docs/operations.md "Lintian").
install -d "$STAGE/DEBIAN" "$STAGE/usr/share/fog-agent/wheels" "$STAGE/lib/systemd/system" \
  "$STAGE/usr/lib/sysusers.d" "$STAGE/usr/share/doc/fog-agent" "$STAGE/usr/share/man/man1" \
  "$STAGE/etc/default" "$STAGE/usr/bin"
install -m 0644 "$WHEELHOUSE"/*.whl "$WHEELHOUSE/requirements.lock" "$STAGE/usr/share/fog-agent/wheels/"
for page in fog-agent.1 fogctl.1; do
  gzip -9n < "$HERE/deb/$page" > "$STAGE/usr/share/man/man1/$page.gz"
  chmod 0644 "$STAGE/usr/share/man/man1/$page.gz"
done
for unit in "$PROJECT"/systemd/fog-*.service "$PROJECT"/systemd/fog-*.timer; do
  install -m 0644 "$unit" "$STAGE/lib/systemd/system/"
done
install -m 0644 "$HERE/deb/sysusers.conf" "$STAGE/usr/lib/sysusers.d/fog-agent.conf"
install -m 0644 "$PROJECT/examples/agent.toml" "$STAGE/usr/share/fog-agent/agent.toml.example"
install -m 0644 "$PROJECT/examples/pipeline.toml" "$STAGE/usr/share/fog-agent/pipeline.toml.example"
install -m 0644 "$HERE/deb/default-fog-agent" "$STAGE/etc/default/fog-agent"
install -m 0644 "$HERE/deb/copyright" "$STAGE/usr/share/doc/fog-agent/copyright"
# A native package's changelog, compressed as policy says (gzip -n: reproducible).
sed "s|@MAINTAINER@|$MAINTAINER|" "$HERE/deb/changelog" | gzip -9n > "$STAGE/usr/share/doc/fog-agent/changelog.gz"
chmod 0644 "$STAGE/usr/share/doc/fog-agent/changelog.gz"
[ -f "$PROJECT/docs/operations.md" ] && install -m 0644 "$PROJECT/docs/operations.md" "$STAGE/usr/share/doc/fog-agent/"
# Commands on PATH through the venv symlink (postinst points it at the current version's venv).
ln -s /opt/fog-agent/venv/bin/fog-agent "$STAGE/usr/bin/fog-agent"
ln -s /opt/fog-agent/venv/bin/fogctl "$STAGE/usr/bin/fogctl"

for script in postinst prerm postrm; do
  sed "s/@VERSION@/$VERSION/g" "$HERE/deb/$script" > "$STAGE/DEBIAN/$script"
  chmod 0755 "$STAGE/DEBIAN/$script"
done
install -m 0644 "$HERE/deb/conffiles" "$STAGE/DEBIAN/conffiles"
# dpkg --verify / debsums check the installed files against these (symlinks have none).
(cd "$STAGE" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) \
  > "$STAGE/DEBIAN/md5sums"
chmod 0644 "$STAGE/DEBIAN/md5sums"
SIZE="$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)"
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$SIZE/" -e "s|@MAINTAINER@|$MAINTAINER|" \
  "$HERE/deb/control.in" > "$STAGE/DEBIAN/control"
find "$STAGE" -type d -exec chmod 0755 {} +

mkdir -p "$OUT"
DEB="$OUT/fog-agent_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
