#!/usr/bin/env bash
# Builds a real Kubernetes control plane for the test suite from the Go module proxy and
# caches it under the user's cache folder; prints the folder holding the binaries.
#
#   kube-apiserver, kube-controller-manager, kube-scheduler,
#   kubectl (the same version as the server)                  k8s.io/kubernetes
#   etcd                                                      go.etcd.io/etcd/server/v3
#   kwok                                                      sigs.k8s.io/kwok (fake nodes)
#   the Gateway API Inference Extension's InferencePool CRD   sigs.k8s.io/gateway-api-inference-extension
#     (another kind named InferencePool, to test both on one cluster)
#   the Prometheus Operator's ServiceMonitor and PodMonitor CRDs  (the chart's and the
#     operator's monitoring objects)                        github.com/prometheus-operator/...
#
# k8s.io/kubernetes and etcd's server module replace their sibling modules with local
# paths, so `go install module@version` refuses them: each is built from a small module of
# our own that requires it and pins every replaced sibling at the matching version. A second
# run finds the binaries and returns at once; a cold build on 2 cores takes several minutes
# and about 1.5 GB of memory (Go's build cache, also under the cache folder, makes a rebuild
# after a version change cheaper).
set -euo pipefail

K8S_VERSION=${WEIR_K8S_VERSION:-v1.36.3}
GIE_VERSION=${WEIR_GIE_VERSION:-v1.0.0}
PROMETHEUS_OPERATOR_VERSION=${WEIR_PROMETHEUS_OPERATOR_VERSION:-v0.89.0}
ETCD_VERSION=${WEIR_ETCD_VERSION:-v3.6.8}
KWOK_VERSION=${WEIR_KWOK_VERSION:-v0.8.0}

cache=${XDG_CACHE_HOME:-$HOME/.cache}/weir/k8s
bin=$cache/$K8S_VERSION-etcd$ETCD_VERSION-kwok$KWOK_VERSION/bin
tools=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)

have_all() {
  for tool in "${tools[@]}"; do [ -x "$bin/$tool" ] || return 1; done
  [ -f "$bin/kwok-stages.yaml" ] && [ -f "$bin/crds/gie-inferencepools.yaml" ] &&
    [ -f "$bin/crds/monitoring.coreos.com_servicemonitors.yaml" ]
}
if have_all; then
  echo "$bin"
  exit 0
fi
if [ -n "${WEIR_K8S_PROBE_ONLY:-}" ]; then
  echo "k8s_controlplane: not built yet ($bin)" >&2
  exit 1
fi
command -v go >/dev/null || { echo "k8s_controlplane: no Go toolchain on PATH" >&2; exit 1; }

export GOCACHE=${GOCACHE:-$cache/go-build}
export GOMODCACHE=${GOMODCACHE:-$cache/go-mod}
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
work=$cache/src
mkdir -p "$bin" "$work"
minor=${K8S_VERSION#v1.}   # 36.3 -> staging modules are v0.36.3

log() { echo "k8s_controlplane: $*" >&2; }

# One module of our own per upstream, so that each keeps its own dependency graph.
build_kubernetes() {
  local dir=$work/kubernetes-$K8S_VERSION
  mkdir -p "$dir"
  (
    cd "$dir"
    if [ ! -f go.sum ]; then
      log "resolving k8s.io/kubernetes $K8S_VERSION"
      printf 'module weir.dev/envtest/kubernetes\n\ngo 1.26\n\nrequire k8s.io/kubernetes %s\n' \
        "$K8S_VERSION" >go.mod
      # The staging modules kubernetes replaces with ./staging/src/k8s.io/<m>.
      local staging
      staging=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
      sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$staging" | while read -r m; do
        echo "replace $m => $m v0.$minor" >>go.mod
      done
      printf 'package envtest\n\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver/app"\n\t_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"\n\t_ "k8s.io/kubernetes/cmd/kube-scheduler/app"\n\t_ "k8s.io/kubectl/pkg/cmd"\n)\n' >deps.go
      go mod tidy
    fi
    # What `kubectl version` and the /version endpoint report (helm checks charts'
    # kubeVersion against it); a plain module build would say v0.0.0-master.
    local version_flags="" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      version_flags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1"
      version_flags+=" -X $pkg.gitMinor=${minor%%.*} -X $pkg.gitTreeState=clean"
    done
    for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      [ -x "$bin/$cmd" ] && continue
      log "building $cmd"
      go build -trimpath -tags providerless -o "$bin/$cmd" -ldflags "-s $version_flags" \
        "k8s.io/kubernetes/cmd/$cmd"
    done
  )
}

build_etcd() {
  [ -x "$bin/etcd" ] && return
  local dir=$work/etcd-$ETCD_VERSION
  mkdir -p "$dir"
  (
    cd "$dir"
    if [ ! -f go.sum ]; then
      log "resolving etcd $ETCD_VERSION"
      {
        printf 'module weir.dev/envtest/etcd\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION"
        for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do
          echo "replace go.etcd.io/etcd/$m => go.etcd.io/etcd/$m $ETCD_VERSION"
        done
      } >go.mod
      printf 'package envtest\n\nimport _ "go.etcd.io/etcd/server/v3/etcdmain"\n' >deps.go
      go mod tidy
    fi
    log "building etcd"
    go build -trimpath -ldflags=-s -o "$bin/etcd" go.etcd.io/etcd/server/v3
  )
}

build_kwok() {
  [ -x "$bin/kwok" ] && [ -f "$bin/kwok-stages.yaml" ] && return
  log "building kwok $KWOK_VERSION"
  GOBIN=$bin go install -trimpath -ldflags=-s "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok runs nothing without stages: kwok's own "fast" set (nodes initialized and kept
  # Ready, pods Ready with an IP, Job pods completed, deleted pods removed).
  local stages
  stages=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    cat "$stages/$f"
    echo "---"
  done >"$bin/kwok-stages.yaml"
}

module_dir() {
  go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}

fetch_crds() {
  mkdir -p "$bin/crds"
  if [ ! -f "$bin/crds/gie-inferencepools.yaml" ]; then
    log "fetching the Gateway API Inference Extension CRD $GIE_VERSION"
    cp "$(module_dir "sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION")/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" \
      "$bin/crds/gie-inferencepools.yaml"
  fi
  if [ ! -f "$bin/crds/monitoring.coreos.com_servicemonitors.yaml" ]; then
    log "fetching the Prometheus Operator CRDs $PROMETHEUS_OPERATOR_VERSION"
    local dir
    dir=$(module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")
    cp "$dir"/example/prometheus-operator-crd/monitoring.coreos.com_{servicemonitors,podmonitors}.yaml \
      "$bin/crds/"
  fi
}

build_etcd
fetch_crds
build_kwok
build_kubernetes
have_all || { log "some binaries are missing from $bin"; exit 1; }
echo "$bin"
