#!/usr/bin/env bash
# Builds the container images for real with podman and runs what is inside
# them (ctest -L deploy; skipped, exit 77, where podman, debootstrap or root
# are missing):
#   tests/deploy/podman_images.sh [WORK_DIR]
# - a debian:12-slim base (and debian:12, the same image) made here with
#   debootstrap --variant=minbase bookworm and podman import, once: the
#   Docker Hub is not used;
# - deploy/docker/Dockerfile (morse:cpu) and Dockerfile.torch (morse:torch)
#   built with podman build --isolation chroot;
# - inside each image (podman image mount, then chroot): the daemons'
#   --help, and --check_config with the arguments the Kubernetes manifests
#   pass (TLS files from make-certs.sh, the overlays' configs);
# - inside morse:torch: python3 imports morse.torch, and the torch-script
#   overlay's train.py trains for real with 2 ranks against 2 morse-server
#   shards, all running in the image, over loopback.
# The CUDA image needs NVIDIA's package repository, which is not reachable
# here: it stays lint-checked only (run_checks.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
skip() { echo "podman_images: SKIPPED: $*"; exit 77; }
command -v podman >/dev/null || skip "podman is not installed (apt-get install podman debootstrap)"
command -v debootstrap >/dev/null || skip "debootstrap is not installed"
[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, chroot and image mounts)"

work="$(mktemp -d "${1:-/var/tmp}/morse-images-XXXXXX")"
mounted=()
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[$i]}" 2>/dev/null || umount -l "${mounted[$i]}" || true; done
  for i in localhost/morse:cpu localhost/morse:torch; do podman image unmount "$i" >/dev/null 2>&1 || true; done
  rm -rf "$work" || true
}
trap cleanup EXIT

if ! podman image exists localhost/debian:12-slim; then
  echo "== debian:12-slim from debootstrap --variant=minbase bookworm"
  # No base image without a Debian mirror: that is this host's network, not
  # the images, so the test is skipped, saying so.
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    { tail -5 "$work/debootstrap.log"; skip "debootstrap could not make the base image (is a Debian mirror reachable?)"; }
  rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
  tar -C "$work/rootfs" -c . | podman import - localhost/debian:12-slim >/dev/null
  rm -rf "$work/rootfs"
fi
podman tag localhost/debian:12-slim localhost/debian:12

for image in cpu torch; do
  file=Dockerfile
  [ "$image" = torch ] && file=Dockerfile.torch
  echo "== podman build -f deploy/docker/$file -t morse:$image"
  start=$SECONDS
  podman build --isolation chroot -f "$root/deploy/docker/$file" -t "localhost/morse:$image" "$root" \
    >"$work/build-$image.log" 2>&1 || { tail -40 "$work/build-$image.log"; exit 1; }
  echo "built morse:$image in $((SECONDS - start)) s: $(podman image inspect --format '{{.Size}}' "localhost/morse:$image") bytes"
done

# What the manifests mount: the job configs and the credentials.
mkdir -p "$work/mnt/certs"
"$root/deploy/make-certs.sh" "$work/mnt/certs" localhost >/dev/null
cp "$root/deploy/k8s/overlays/cpu-demo/job.textproto" "$work/mnt/cpu-demo.textproto"
cp "$root/deploy/k8s/overlays/torch-script/job.textproto" "$work/mnt/torch-script.textproto"
cp "$root/deploy/k8s/overlays/torch-script/train.py" "$work/mnt/train.py"
chmod -R a+rX "$work/mnt"

# Mounts an image and binds $work/mnt, /proc and /dev inside it; sets root.
declare -A roots
enter() {
  root_of="$(podman image mount "localhost/morse:$1")"
  roots[$1]="$root_of"
  mount --bind "$work/mnt" "$root_of/mnt"
  mounted+=("$root_of/mnt")
  for d in proc dev; do mount --bind "/$d" "$root_of/$d"; mounted+=("$root_of/$d"); done
}
in_image() { local r="$1"; shift; chroot --userspec=10001:10001 "$r" "$@"; }

tls_server=(--tls_cert=/mnt/certs/server.pem --tls_key=/mnt/certs/server.key --tls_ca=/mnt/certs/ca.pem
            --token_file=/mnt/certs/token)
tls_worker=(--tls_ca=/mnt/certs/ca.pem --tls_cert=/mnt/certs/client.pem --tls_key=/mnt/certs/client.key
            --token_file=/mnt/certs/token)
for image in cpu torch; do
  enter "$image"
  r="${roots[$image]}"
  echo "== inside morse:$image"
  for bin in morse-server morse-worker; do
    in_image "$r" "/usr/local/bin/$bin" --help >"$work/help.txt" 2>&1 || true
    grep -q -- "--config" "$work/help.txt" || { cat "$work/help.txt"; echo "$bin --help says nothing of --config" >&2; exit 1; }
    echo "$bin --help: $(wc -l <"$work/help.txt") lines"
  done
  in_image "$r" /usr/local/bin/morse-server --config=/mnt/cpu-demo.textproto --shard=1 --listen=0.0.0.0:7000 \
    "${tls_server[@]}" --checkpoint_dir=/tmp --metrics_listen=0.0.0.0:9090 --health_listen=0.0.0.0:7001 --check_config
  in_image "$r" /usr/local/bin/morse-worker --config=/mnt/cpu-demo.textproto --rank=1 \
    --servers=morse-server-0.morse-server:7000,morse-server-1.morse-server:7000 "${tls_worker[@]}" \
    --checkpoint_dir=/tmp --metrics_listen=0.0.0.0:9090 --rejoin --check_config
  in_image "$r" /usr/local/bin/morse-server --config=/mnt/torch-script.textproto --shard=0 --listen=0.0.0.0:7000 \
    "${tls_server[@]}" --check_config
done

echo "== morse.torch inside morse:torch"
r="${roots[torch]}"
in_image "$r" python3 -c 'import morse.torch, morse._native as n, torch; n._load(); print("morse.torch imports and loads libmorse.so with torch", torch.__version__)'
# The torch-script overlay's script, for real: 2 shards and 2 ranks in the image.
ports=()
for s in 0 1; do
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  ports+=("127.0.0.1:$port")
  timeout 300 chroot --userspec=10001:10001 "$r" /usr/local/bin/morse-server --config=/mnt/torch-script.textproto \
    --shard="$s" --listen="127.0.0.1:$port" --insecure --checkpoint_dir=/tmp >"$work/server-$s.log" 2>&1 &
  pids+=($!)
done
servers="$(IFS=,; echo "${ports[*]}")"
for rank in 0 1; do
  timeout 300 chroot --userspec=10001:10001 "$r" env HOME=/tmp MORSE_INSECURE=1 MORSE_RANK=$rank RANK=$rank \
    MORSE_WORLD_SIZE=2 WORLD_SIZE=2 MORSE_SERVERS="$servers" MORSE_CONFIG=/mnt/torch-script.textproto \
    python3 /mnt/train.py >"$work/rank-$rank.log" 2>&1 &
  pids+=($!)
done
status=0
for rank in 0 1; do wait "${pids[$((2 + rank))]}" || status=$?; done
cat "$work/rank-0.log"
tail -1 "$work/rank-1.log"
[ "$status" = 0 ] || { tail -20 "$work"/rank-*.log "$work"/server-*.log; echo "train.py failed in the image" >&2; exit 1; }
a="$(grep -o 'checksum [0-9a-f]*' "$work/rank-0.log")"; b="$(grep -o 'checksum [0-9a-f]*' "$work/rank-1.log")"
[ -n "$a" ] && [ "$a" = "$b" ] || { echo "the ranks' models differ: $a vs $b" >&2; exit 1; }
echo "podman_images: both images built; daemons and morse.torch ran inside them; train.py ranks agree ($a)"
