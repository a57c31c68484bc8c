"""`weir engine` as the subprocess `weir up` spawns."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from weir.commands import engine as engine_command
from weir.local.ports import free_port, wait_for_port


def test_weir_engine_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weir.cli", "engine", "--port", str(port),
         "--model", "tiny-test", "--max-total-tokens", "4096", "--page-size", "16",
         "--enable-metrics", "--api-version", "0.5.5", "--speed-factor", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_port(port, timeout_s=30)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/get_server_info", timeout=10) as resp:
            info = json.load(resp)
        assert info["model_path"] == "tiny-test"
        assert info["max_total_num_tokens"] == 4096
        assert info["page_size"] == 16
        assert info["version"] == "0.5.5"
        request = urllib.request.Request(
            f"{base}/generate",
            data=json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 4,
                                                               "ignore_eos": True}}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.load(resp)["meta_info"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
            assert 'model_name="tiny-test"' in resp.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"127.0.0.1:{port}" in out


def test_weir_engine_rejects_bad_flags() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "weir.cli", "engine", "--page-size", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "page_size must be at least 1" in proc.stderr


def test_weir_engine_takes_sglangs_hierarchical_cache_flags() -> None:
    parser = argparse.ArgumentParser()
    engine_command.configure(parser)
    flags = ["--enable-hicache", "--hicache-ratio", "1.5", "--hicache-size", "4"]
    config = engine_command.config_from_args(parser.parse_args(flags))
    assert config.enable_hierarchical_cache
    assert (config.hicache_ratio, config.hicache_size, config.hicache_write_policy) == (
        1.5,
        4,
        "write_back",
    )
    assert not engine_command.config_from_args(parser.parse_args([])).enable_hierarchical_cache


def test_weir_engine_takes_sglangs_disaggregation_flags() -> None:
    parser = argparse.ArgumentParser()
    engine_command.configure(parser)
    flags = ["--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "9100",
             "--disaggregation-transfer-backend", "nixl", "--num-reserved-decode-tokens", "64",
             "--kv-link-bytes-per-s", "1e9"]  # fmt: skip
    config = engine_command.config_from_args(parser.parse_args(flags))
    assert (config.disaggregation_mode, config.disaggregation_bootstrap_port) == ("decode", 9100)
    assert config.disaggregation_transfer_backend == "nixl"
    assert (config.num_reserved_decode_tokens, config.kv_link_bytes_per_s) == (64, 1e9)
    assert engine_command.config_from_args(parser.parse_args([])).disaggregation_mode == "null"
    # As SGLang: the fake backend is a decode-only harness.
    refused = ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"]
    with pytest.raises(ValueError, match="does not support 'fake'"):
        engine_command.config_from_args(parser.parse_args(refused))
