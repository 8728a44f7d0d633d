#!/usr/bin/env bash
# Makes a private CA and the credentials of one Morse job with openssl:
#
#   deploy/make-certs.sh [--workers N] OUT_DIR [SERVER_NAME...]
#
# OUT_DIR gets ca.pem/ca.key (the job's CA), server.pem/server.key (valid for
# every SERVER_NAME: DNS names or IPv4 addresses; default localhost and
# 127.0.0.1), client.pem/client.key (a worker certificate for mutual TLS) and
# token (a random bearer token any rank may use). With --workers N, also one
# token per rank, token-0 .. token-<N-1>, and tokens, the servers' file that
# ties each to its rank ('rank=R TOKEN' lines): give the servers
# --token_file tokens and worker R --token_file token-{rank}, and no worker
# can push as another. Keys are P-256, certificates valid for
# MORSE_CERT_DAYS days (default 365). For tests and first deployments; use
# your own PKI in production. Refuses to overwrite an existing CA.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -ge 1 ] && exit 0 || exit 2
fi
workers=0
if [ "$1" = "--workers" ]; then
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "make-certs: --workers needs a positive count" >&2; exit 2; }
  workers="$2"
  shift 2
  [ $# -ge 1 ] || { echo "make-certs: give OUT_DIR" >&2; exit 2; }
fi
command -v openssl >/dev/null || { echo "make-certs: needs openssl (apt-get install openssl)" >&2; exit 2; }
out="$1"
shift
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(localhost 127.0.0.1)
days="${MORSE_CERT_DAYS:-365}"
mkdir -p "$out"
[ -e "$out/ca.key" ] && { echo "make-certs: $out/ca.key exists; not overwriting" >&2; exit 2; }
umask 077

san=""
for n in "${names[@]}"; do
  if [[ "$n" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
done
san="${san%,}"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
# sign NAME CN EXTENSIONS: NAME.csr signed by the CA into NAME.pem
sign() {
  openssl req -new -key "$out/$1.key" -subj "/CN=$2" -out "$out/$1.csr"
  printf '%s\n' "$3" >"$out/$1.ext"
  openssl x509 -req -in "$out/$1.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" -CAcreateserial \
    -days "$days" -extfile "$out/$1.ext" -out "$out/$1.pem" 2>/dev/null
  rm -f "$out/$1.csr" "$out/$1.ext"
}

key "$out/ca.key"
openssl req -x509 -new -key "$out/ca.key" -subj "/CN=morse-ca" -days "$days" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$out/ca.pem"
key "$out/server.key"
sign server morse-server "subjectAltName=$san
extendedKeyUsage=serverAuth
basicConstraints=CA:FALSE"
key "$out/client.key"
sign client morse-worker "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
openssl rand -hex 32 >"$out/token"
per_rank=""
if [ "$workers" -gt 0 ]; then
  : >"$out/tokens"
  for ((r = 0; r < workers; r++)); do
    openssl rand -hex 32 >"$out/token-$r"
    printf 'rank=%d %s\n' "$r" "$(cat "$out/token-$r")" >>"$out/tokens"
  done
  chmod 600 "$out"/token-* "$out/tokens"
  per_rank=", token-0..token-$((workers - 1)) and tokens (per-rank)"
fi
rm -f "$out/ca.srl"
chmod 600 "$out"/*.key "$out/token"
chmod 644 "$out"/*.pem
echo "make-certs: wrote ca.pem, server.pem/key ($san), client.pem/key, token$per_rank to $out"
