#!/usr/bin/env bash
# Installs the Weir chart and a sample InferencePool on a real cluster (kind, k3d, or any
# cluster KUBECONFIG points at) and checks that the operator renders the pool's children,
# reports its status from the control plane, cleans up on delete, and that `helm test`
# passes. Skipped, and says so, when KUBECONFIG is not set.
#
#   KUBECONFIG=~/.kube/config WEIR_IMAGE=ghcr.io/weir-dev/weir:0.1.0 e2e/cluster/install.sh
#
# The Weir image must be pullable by the cluster (for kind: `kind load docker-image`).
# The pool runs zero engines (replicas.min 0) so that no GPU is needed: the check covers
# the operator, the chart, Redis and the status loop, not SGLang itself.
set -euo pipefail

if [ -z "${KUBECONFIG:-}" ]; then
  echo "SKIPPED: KUBECONFIG is not set; e2e/cluster/install.sh needs a real cluster (kind, k3d, ...)."
  exit 0
fi

root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(python3 "$root/scripts/k8s_tools.py" 2>/dev/null || true)
helm=${HELM:-$( [ -x "$bin/helm" ] && echo "$bin/helm" || command -v helm )}
kubectl=${KUBECTL:-$( [ -x "$bin/kubectl" ] && echo "$bin/kubectl" || command -v kubectl )}
namespace=${WEIR_NAMESPACE:-weir-e2e}
image=${WEIR_IMAGE:-ghcr.io/weir-dev/weir:0.1.0}
release=weir
pool=e2e-pool

step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAILED: $*" >&2; "$kubectl" -n "$namespace" describe inferencepool "$pool" >&2 || true; exit 1; }
cleanup() {
  "$kubectl" -n "$namespace" delete inferencepool "$pool" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  if [ -z "${WEIR_KEEP:-}" ]; then
    "$helm" uninstall "$release" -n "$namespace" >/dev/null 2>&1 || true
    "$kubectl" delete namespace "$namespace" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

step "cluster"
"$kubectl" version
"$kubectl" get nodes

step "install the chart (image $image) into $namespace"
"$helm" upgrade --install "$release" "$root/charts/weir" -n "$namespace" --create-namespace \
  --set image.repository="${image%:*}" --set image.tag="${image##*:}" \
  --set "router.pools[0].name=$pool" --set "router.pools[0].model=Qwen/Qwen2.5-0.5B-Instruct" \
  --set operator.statusIntervalSeconds=2 \
  --wait --timeout 5m
"$kubectl" -n "$namespace" rollout status deployment/"$release"-operator --timeout=3m
"$kubectl" get crd inferencepools.inference.weir.dev

step "the API server enforces the CRD's CEL rules"
if "$kubectl" -n "$namespace" apply --dry-run=server -f - >/dev/null 2>&1 <<YAML
apiVersion: inference.weir.dev/v1alpha1
kind: InferencePool
metadata: {name: invalid}
spec:
  model: {name: m}
  kv: {lowWatermark: 0.9, highWatermark: 0.8}
YAML
then fail "a pool with lowWatermark > highWatermark was accepted"; fi

step "create pool $pool"
"$kubectl" -n "$namespace" apply -f - <<YAML
apiVersion: inference.weir.dev/v1alpha1
kind: InferencePool
metadata: {name: $pool}
spec:
  model: {name: Qwen/Qwen2.5-0.5B-Instruct, contextLength: 4096}
  replicas: {min: 0, max: 1}
YAML

step "children rendered"
for kind in deployment service configmap poddisruptionbudget; do
  name=$pool; [ "$kind" = configmap ] && name=$pool-policy
  for _ in $(seq 60); do "$kubectl" -n "$namespace" get "$kind" "$name" >/dev/null 2>&1 && break; sleep 2; done
  "$kubectl" -n "$namespace" get "$kind" "$name" >/dev/null || fail "$kind/$name was not created"
done
"$kubectl" -n "$namespace" get configmap "$pool-policy" -o jsonpath='{.data.policy\.json}' | grep -q '"pool":"'"$pool"'"' \
  || fail "the policy ConfigMap does not carry the pool policy"

step "status from the control plane"
"$kubectl" -n "$namespace" wait inferencepool/"$pool" --for=condition=ControlPlaneReachable --timeout=2m \
  || fail "the operator does not reach Redis"
"$kubectl" -n "$namespace" wait inferencepool/"$pool" --for=condition=Ready --timeout=2m \
  || fail "the pool did not become Ready"
"$kubectl" -n "$namespace" get inferencepool "$pool"

step "helm test"
"$helm" test "$release" -n "$namespace" --timeout 3m || fail "helm test failed"

step "delete: the finalizer clears the control plane and the pool goes"
"$kubectl" -n "$namespace" delete inferencepool "$pool" --timeout=2m
"$kubectl" -n "$namespace" get inferencepool "$pool" >/dev/null 2>&1 && fail "the pool is still there"

echo
echo "PASSED: chart installed, pool rendered, status Ready with the control plane reachable, helm test, cleanup."
