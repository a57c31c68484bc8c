"""A throwaway Prometheus server on loopback that scrapes a local fleet.

The e2e tests use it to prove that every dashboard query returns data from a real scrape of
Weir's processes, and `weir up --prometheus` uses it so a user can point Grafana at a local
fleet. Prometheus is Debian's `prometheus` package (scripts/bootstrap.sh installs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from weir.local.ports import free_port, wait_for_port
from weir.local.process import LocalService, stop_process


class PrometheusNotInstalledError(RuntimeError):
    pass


class PrometheusServer(LocalService):
    """One `prometheus` process scraping fixed targets, with no retention to speak of.

    `jobs` maps a job name to its `host:port` targets; each target is scraped at
    `scrape_interval_s` on `/metrics`.
    """

    def __init__(
        self,
        jobs: Mapping[str, Sequence[str]],
        *,
        scrape_interval_s: float = 1.0,
        port: int | None = None,
    ) -> None:
        self.jobs = {name: list(targets) for name, targets in jobs.items()}
        self.scrape_interval_s = scrape_interval_s
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="weir-prometheus-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> dict[str, object]:
        interval = f"{max(1, round(self.scrape_interval_s * 1000))}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": name, "static_configs": [{"targets": targets}]}
                for name, targets in self.jobs.items()
            ],
        }

    def start(self) -> PrometheusServer:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusNotInstalledError(
                "prometheus is not installed; run scripts/bootstrap.sh dev "
                "(apt-get install prometheus)"
            )
        workdir = Path(self._dir.name)
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config()))
        args = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, timeout_s=30)
        self._wait_ready(timeout_s=30)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        # The port opens before the TSDB is loaded; until then the API answers 503.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return
            except urllib.error.HTTPError as exc:
                exc.close()
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus on port {self.port} not ready after {timeout_s}s")
            time.sleep(0.05)

    def query(self, expr: str) -> list[dict[str, object]]:
        """Evaluate an instant PromQL query; raise ValueError if Prometheus rejects it."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            with exc:
                body = json.load(exc)
            raise ValueError(f"prometheus rejected {expr!r}: {body.get('error')}") from None
        result: list[dict[str, object]] = body["data"]["result"]
        return result

    def targets_up(self) -> dict[str, bool]:
        """Scrape health per target instance, from Prometheus's own `up` series."""
        return {
            str(sample["metric"]["instance"]): sample["value"][1] == "1"  # type: ignore[index]
            for sample in self.query("up")
        }

    def wait_for_scrapes(self, scrapes: int = 2, timeout_s: float = 60.0) -> None:
        """Block until every target was scraped successfully at least `scrapes` times."""
        wanted = sum(len(t) for t in self.jobs.values())
        deadline = time.monotonic() + timeout_s
        expr = f"count_over_time(up[1h]) >= {scrapes} and up == 1"
        while time.monotonic() < deadline:
            if len(self.query(expr)) >= wanted:
                return
            time.sleep(self.scrape_interval_s / 2)
        raise TimeoutError(f"prometheus did not scrape all {wanted} targets {scrapes} times")

    def stop(self) -> None:
        stop_process(self._proc, timeout_s=10)
        self._proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
