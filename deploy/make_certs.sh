#!/usr/bin/env bash
# Makes the certificates of a ferry cluster (docs/api.md, "Authentication"):
# one CA, then one certificate per daemon or operator, signed by it.
#
#   deploy/make_certs.sh DIR NAME [SAN ...]
#
# DIR/ca.pem and DIR/ca.key are created the first time (keep ca.key off the
# nodes); DIR/NAME.pem and DIR/NAME.key (mode 0600) each time. NAME is the
# certificate's CN, its holder's identity: a daemon's must be its --node.
# A daemon's certificate also needs every host name or IP its peers reach
# it at, as SAN arguments: DNS:gpu-node-7.example.com IP:10.0.3.7 (DNS:NAME
# is always added). An operator's (remote ferryctl) needs none, and should
# get a NAME that is no node's.
#
# ECDSA P-256 keys; certificates valid for 825 days (the CA for 10 years).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
dir=$1
name=$2
shift 2
case "$name" in
  *[!A-Za-z0-9._-]*|"") echo "make_certs: NAME '$name' must be [A-Za-z0-9._-]+" >&2; exit 2 ;;
esac
command -v openssl >/dev/null || { echo "make_certs: needs openssl (apt-get install openssl)" >&2; exit 1; }
umask 077
mkdir -p "$dir"
if [ ! -f "$dir/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" -days 3650 \
    -subj "/CN=ferry cluster CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  chmod 0644 "$dir/ca.pem"
fi
san="DNS:$name"
for s in "$@"; do san="$san,$s"; done
ext=$(mktemp)
csr=$(mktemp)
trap 'rm -f "$ext" "$csr"' EXIT
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$san" >"$ext"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$dir/$name.key" -out "$csr" -subj "/CN=$name" 2>/dev/null
openssl x509 -req -in "$csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" -days 825 -extfile "$ext" \
  -out "$dir/$name.pem" 2>/dev/null
chmod 0600 "$dir/$name.key"
chmod 0644 "$dir/$name.pem"
echo "$dir/$name.pem ($san), key $dir/$name.key, CA $dir/ca.pem"
