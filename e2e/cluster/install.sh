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
#
# WEIR_OPERATOR=local is for a cluster whose nodes run no containers (the test suite's
# control plane, with kwok's fake node): the chart's operator Deployment is scaled to zero
# and `weir operator` runs here instead, authenticated as the chart's ServiceAccount (so
# the chart's RBAC is what it gets), against WEIR_REDIS_URL (the chart's Redis is off);
# `helm test`, which needs a kubelet, is replaced by a server-side check of its pod.
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
local_operator=${WEIR_OPERATOR:-}
python=${PYTHON:-python3}
operator_pid=""
image=${WEIR_IMAGE:-ghcr.io/weir-dev/weir:0.1.0}
release=weir
pool=e2e-pool

step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAILED: $*" >&2; "$kubectl" -n "$namespace" describe inferencepools.inference.weir.dev "$pool" >&2 || true; exit 1; }
cleanup() {
  "$kubectl" -n "$namespace" delete inferencepools.inference.weir.dev "$pool" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  [ -n "$operator_pid" ] && kill "$operator_pid" 2>/dev/null && wait "$operator_pid" 2>/dev/null || true
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
redis_values=()
if [ -n "$local_operator" ]; then
  [ -n "${WEIR_REDIS_URL:-}" ] || fail "WEIR_OPERATOR=local needs WEIR_REDIS_URL"
  redis_values=(--set redis.enabled=false --set "redis.external.url=$WEIR_REDIS_URL")
fi
"$helm" upgrade --install "$release" "$root/charts/weir" -n "$namespace" --create-namespace \
  --set image.repository="${image%:*}" --set image.tag="${image##*:}" \
  --set "router.pools[0].name=$pool" --set "router.pools[0].model=Qwen/Qwen2.5-0.5B-Instruct" \
  --set operator.statusIntervalSeconds=2 "${redis_values[@]}" \
  --wait --timeout 5m
if [ -n "$local_operator" ]; then
  step "run the operator here, as the chart's ServiceAccount"
  "$kubectl" -n "$namespace" scale deployment "$release"-operator --replicas=0
  token=$("$kubectl" -n "$namespace" create token "$release"-operator --duration=1h)
  operator_kubeconfig=$(mktemp)
  "$kubectl" config view --raw --minify --flatten -o json | "$python" -c '
import json, sys
config = json.load(sys.stdin)
config["users"] = [{"name": "operator", "user": {"token": sys.argv[1]}}]
config["contexts"][0]["context"]["user"] = "operator"
print(json.dumps(config))' "$token" >"$operator_kubeconfig"
  KUBECONFIG=$operator_kubeconfig WEIR_REDIS_URL=$WEIR_REDIS_URL WEIR_STATUS_INTERVAL_S=2 \
    PYTHONPATH="$root:$root/operator" "$python" -m weir.cli operator --namespace "$namespace" \
    --liveness "" >"$operator_kubeconfig.log" 2>&1 &
  operator_pid=$!
else
  "$kubectl" -n "$namespace" rollout status deployment/"$release"-operator --timeout=3m
fi
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
"$kubectl" -n "$namespace" wait inferencepools.inference.weir.dev/"$pool" --for=condition=ControlPlaneReachable --timeout=2m \
  || fail "the operator does not reach Redis"
"$kubectl" -n "$namespace" wait inferencepools.inference.weir.dev/"$pool" --for=condition=Ready --timeout=2m \
  || fail "the pool did not become Ready"
"$kubectl" -n "$namespace" get inferencepools.inference.weir.dev "$pool"

if [ -n "$local_operator" ]; then
  step "helm test's pod, checked by the server (no kubelet runs it here)"
  "$helm" get hooks "$release" -n "$namespace" |
    "$kubectl" -n "$namespace" apply --dry-run=server -f - || fail "the helm test pod is invalid"
else
  step "helm test"
  "$helm" test "$release" -n "$namespace" --timeout 3m || fail "helm test failed"
fi

step "delete: the finalizer clears the control plane and the pool goes"
"$kubectl" -n "$namespace" delete inferencepools.inference.weir.dev "$pool" --timeout=2m
"$kubectl" -n "$namespace" get inferencepools.inference.weir.dev "$pool" >/dev/null 2>&1 && fail "the pool is still there"

echo
echo "PASSED: chart installed, pool rendered, status Ready with the control plane reachable, helm test, cleanup."
