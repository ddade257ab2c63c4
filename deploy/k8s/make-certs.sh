#!/usr/bin/env bash
# The mesh's mutual-TLS certificates for clusters WITHOUT cert-manager (with it, the overlays'
# cert-manager component issues and renews them; see docs/operations.md, "Mutual TLS").
#
#   deploy/k8s/make-certs.sh DIR            # write the files under DIR
#   deploy/k8s/make-certs.sh --apply DIR    # ... and create/replace the Secrets with kubectl
#
# Writes a mesh CA and, each as DIR/<secret>/{tls.crt,tls.key,ca.crt} (the layout cert-manager
# gives its Secrets, so the Deployments mount either the same way):
#   llm-mesh-retriever-tls       retriever server certificate (its Service's DNS names)
#   llm-mesh-session-tls         session server certificate
#   llm-mesh-router-client-tls   the router's client certificate, the one the services admit
# The server certificates may also authenticate as clients: their pods' exec probes show them.
# Nothing renews these: re-run before DAYS pass, then `kubectl -n NAMESPACE rollout restart
# deployment` (the services read their certificates at start). Keep DIR/ca.key off shared disks,
# or delete it: a re-run makes a new CA, and a restart of every Deployment picks it up.
# Env: NAMESPACE (llm-mesh), DAYS (365), CLUSTER_DOMAIN (cluster.local).
set -euo pipefail

apply=0
if [[ "${1:-}" == "--apply" ]]; then
    apply=1
    shift
fi
if [[ $# -ne 1 ]]; then
    sed -n '2,17p' "$0" >&2
    exit 2
fi
dir=$1
namespace=${NAMESPACE:-llm-mesh}
days=${DAYS:-365}
domain=${CLUSTER_DOMAIN:-cluster.local}
mkdir -p "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key "$dir/ca.key"
openssl req -x509 -new -key "$dir/ca.key" -sha256 -days "$((days + 30))" -subj "/CN=llm-mesh CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.crt"

# leaf SECRET CN EXTENDED_KEY_USAGE [SERVICE]: a certificate signed by the mesh CA.
leaf() {
    local out="$dir/$1" cn=$2 eku=$3 service=${4:-}
    mkdir -p "$out"
    key "$out/tls.key"
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature"
        echo "extendedKeyUsage=$eku"
        if [[ -n "$service" ]]; then
            # Every name the Service answers to inside the cluster; the router dials the last.
            echo "subjectAltName=DNS:$service,DNS:$service.$namespace,DNS:$service.$namespace.svc,DNS:$service.$namespace.svc.$domain"
        fi
    } >"$out/ext.cnf"
    openssl req -new -key "$out/tls.key" -subj "/CN=$cn" \
        | openssl x509 -req -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -sha256 \
            -days "$days" -extfile "$out/ext.cnf" -out "$out/tls.crt" 2>/dev/null
    rm "$out/ext.cnf"
    cp "$dir/ca.crt" "$out/ca.crt"
}

leaf llm-mesh-retriever-tls "retriever.$namespace.svc" serverAuth,clientAuth retriever
leaf llm-mesh-session-tls "session.$namespace.svc" serverAuth,clientAuth session
leaf llm-mesh-router-client-tls router clientAuth
rm -f "$dir/ca.srl"

if [[ $apply -eq 1 ]]; then
    for secret in llm-mesh-retriever-tls llm-mesh-session-tls llm-mesh-router-client-tls; do
        kubectl -n "$namespace" create secret generic "$secret" --type=kubernetes.io/tls \
            --from-file="$dir/$secret/tls.crt" --from-file="$dir/$secret/tls.key" \
            --from-file="$dir/$secret/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
    done
fi
echo "mesh certificates in $dir (valid $days days)"
