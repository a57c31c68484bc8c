"""Running the operator in a test: kopf for real, in a thread of its own, against the
kubeconfig the test points it at."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
from kubernetes_asyncio.config import kube_config

from fleet_operator.config import OperatorConfig
from fleet_operator.handlers import build_registry
from tests import polling


@contextlib.contextmanager
def operator_thread(settings: OperatorConfig, namespaces: list[str]) -> Iterator[None]:
    """kopf in a thread with an event loop of its own, as it runs in its pod: a test may
    block (kubectl, helm) without stalling the operator, and a stop is kopf's graceful
    one (timers stopped, cleanup handlers run)."""
    ready, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=build_registry(settings),
                    namespaces=namespaces,
                    standalone=True,
                    ready_flag=ready,
                    stop_flag=stop,
                )
            )
        except BaseException as exc:  # reported to the test below
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    ready.wait(60)
    if failure:
        raise failure[0]
    try:
        yield
    finally:
        stop.set()
        thread.join(60)
        assert not thread.is_alive(), "the operator did not stop within 60 s"


def point_clients_at(monkeypatch: Any, kubeconfig: Path) -> None:
    """kopf's login and the operator's own client both read the default kubeconfig
    location, which kubernetes_asyncio fixes at import from $KUBECONFIG."""
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


# Pods start in seconds: poll the API server gently.
until = functools.partial(polling.until, timeout_s=30.0, every_s=0.1)
