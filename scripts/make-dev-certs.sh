#!/usr/bin/env bash
# Makes a development CA and the certificates and tenants file that
# deploy/docker-compose.secure.yml and deploy/secure/k8s expect, under DIR
# (default deploy/secrets, which git ignores):
#   ca.crt ca.key        the CA: signs the server's and the clients' certificates
#   server.crt/.key      the server, named ampd, localhost and 127.0.0.1
#   probe.crt/.key       the health probe's client certificate (CN probe)
#   alice.crt/.key       a client certificate naming the tenant alice
#   tenants              alice and bob with the SHA-256 of their tokens
#   alice.token bob.token the tokens themselves, for clients (AMPD_TOKEN)
# For trying the secured deployment, not for production: a real CA keeps its
# key elsewhere, and tokens come from a secret store.
set -euo pipefail
dir="${1:-$(dirname "$0")/../deploy/secrets}"
mkdir -p "$dir"
cd "$dir"
umask 077
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }
key ca
openssl req -x509 -new -key ca.key -out ca.crt -days 365 -subj "/CN=ampd dev CA" \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
leaf() {  # name, extensions
  key "$1"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$1"
  printf '%s\n' "$2" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
leaf server "subjectAltName=DNS:ampd,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
leaf probe "extendedKeyUsage=clientAuth"
leaf alice "extendedKeyUsage=clientAuth"
: > tenants
for tenant in alice bob; do
  openssl rand -hex 24 > "$tenant.token"
  printf '%s %s\n' "$tenant" "$(tr -d '\n' < "$tenant.token" | sha256sum | cut -c1-64)" >> tenants
done
# The container runs as uid 10001: compose bind-mounts these files as they
# are, so they must be readable by it (the keys stay out of other users'
# reach on a shared host by the directory's mode).
chmod 0700 .
chmod 0644 ./*.crt server.key probe.key alice.key tenants
chmod 0600 ca.key
echo "make-dev-certs: wrote $(pwd)"
