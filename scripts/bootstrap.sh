#!/usr/bin/env bash
# Installs everything Weir needs on a fresh Debian machine, idempotently.
#   scripts/bootstrap.sh run   - what `weir up` needs: a virtualenv with Weir and redis-server
#   scripts/bootstrap.sh dev   - also test and lint tools, redis-sentinel, prometheus, helm/kubectl,
#                                and the real parts the tests run against (a Kubernetes
#                                control plane built from Go modules, SGLang on the CPU)
set -euo pipefail
mode=${1:-dev}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=.venv

apt_packages=(redis-server)
# redis-tools' redis-cli makes the tests' Redis Cluster (redis-server pulls it in; named so
# that a trimmed install is caught here, not by a skipped tier).
# gcc and libc6-dev: mypyc's build of the simulator (`weir bench fleet --compiled`, tested).
if [ "$mode" = dev ]; then apt_packages+=(redis-tools redis-sentinel prometheus gcc libc6-dev); fi

missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]} with apt-get" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian packages start system services; Weir starts its own servers on free ports.
  for svc in redis-server redis-sentinel prometheus; do
    $sudo systemctl disable --now "$svc" >/dev/null 2>&1 || $sudo service "$svc" stop >/dev/null 2>&1 || true
  done
fi

# Real SGLang for the `sglang` tier, in venvs of its own (its pins clash with Weir's):
# 0.5.23 and 0.5.5 with torch 2.14.1, and a tiny model built offline; cached under
# ~/.cache/weir/sglang. Without them the tier skips and says why; CI must have them.
if [ "$mode" = dev ]; then
  for version in 0.5.23 0.5.5; do
    if ! "$(command -v python3.11 || command -v python3)" scripts/sglang_env.py "$version" >/dev/null; then
      [ -z "${CI:-}" ] || { echo "bootstrap: installing SGLang $version failed" >&2; exit 1; }
      echo "bootstrap: no SGLang $version (see above); the sglang tier will skip it" >&2
    fi
  done
fi

if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
stamp="$venv/.weir-$mode-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing Python packages into $venv ($mode)" >&2
  # Some machines' pip config names local index folders that may be absent; pip warns
  # once per package about them, and setuptools warns that an editable install is one:
  # noise that buries real errors.
  pip_install() {
    PYTHONWARNINGS=ignore::UserWarning "$venv/bin/python" -m pip install -q "$@" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  }
  pip_install --upgrade "pip>=25.1"
  group=(); [ "$mode" = dev ] && group=(--group dev)
  # torch comes from the SGLang installer's wheel folder when it is there (pip's own
  # cache keeps nothing on these machines): one download for the whole project.
  wheels=${XDG_CACHE_HOME:-$HOME/.cache}/weir/sglang/wheels
  links=(); [ -d "$wheels" ] && links=(--find-links "$wheels")
  pip_install -e . "${group[@]}" "${links[@]}"
  touch "$stamp"
fi

if [ "$mode" = dev ]; then
  "$venv/bin/python" scripts/k8s_tools.py >/dev/null
  # The real Kubernetes control plane for the `kube` tier: built once (minutes), cached
  # under ~/.cache/weir. Without it the tier skips and says why; CI must have it.
  if ! scripts/k8s_controlplane.sh >/dev/null; then
    [ -z "${CI:-}" ] || { echo "bootstrap: building the Kubernetes control plane failed" >&2; exit 1; }
    echo "bootstrap: no Kubernetes control plane (see above); the kube tier will skip" >&2
  fi
fi
