"""The load generators `weir bench live` drives, none of them written here.

Each client runs as a subprocess in its own Python (`inference-perf` in a venv of its own,
SGLang's `bench_serving` in the venv `scripts/sglang_env.py` installs), against one base
URL at a time, and its own report file is read back into a `Result`: the tool's figures,
not figures recomputed here.

Against reference engines both count tokens with a local ASCII tokenizer written here, one
token per printable ASCII character: there is no Hugging Face hub to download one from, the
reference engine counts one token per byte and generates printable ASCII, and the tools'
random generators decode random token ids, which with any byte-level vocabulary could be
invalid UTF-8. So a prompt the tool sizes at N tokens is N tokens to the engine, and the
tool's count of the streamed text equals the engine's `usage`. Against SGLang's own server
they count with the model's tokenizer, and the counts differ as docs/benchmarks.md says.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from weir.benchmarks._tool_venv import ToolVenv, ToolVenvError
from weir.local import sglang_cpu

# inference-perf 0.7.0 and its dependency closure as pip resolved it on Python 3.12.
INFERENCE_PERF = ToolVenv(
    tool="inference-perf",
    version="0.7.0",
    python=(3, 12),
    pins=(
        "aiofiles==25.1.0", "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0",
        "annotated-doc==0.0.7", "annotated-types==0.8.0", "anyio==4.16.0", "attrs==26.1.0",
        "av==19.0.2", "boto3==1.44.8", "botocore==1.44.8", "certifi==2026.10.19.post1",
        "cffi==2.1.1", "charset-normalizer==3.5.3", "click==8.5.1", "cryptography==50.0.2",
        "datasets==5.2.0", "dill==0.4.1", "filelock==4.3.1", "frozenlist==1.8.0",
        "fsspec==2026.9.0", "google-api-core==2.44.0", "google-auth==2.63.0",
        "google-cloud-core==2.8.0", "google-cloud-storage==3.17.1", "google-crc32c==1.9.0",
        "google-resumable-media==2.11.0", "googleapis-common-protos==1.76.0", "h11==0.16.0",
        "hf-xet==1.8.0", "httpcore==1.0.9", "httpx==0.28.1", "huggingface_hub==1.33.0",
        "idna==3.20", "Jinja2==3.1.6", "jmespath==1.1.0", "markdown-it-py==4.3.0",
        "MarkupSafe==3.0.4", "mdurl==0.1.2", "multidict==7.2.1", "multiprocess==0.70.19",
        "numpy==2.5.5", "opentelemetry-api==1.45.2", "packaging==26.4", "pandas==3.1.1",
        "pillow==13.0.0", "prometheus_client==0.26.0", "propcache==0.5.4", "proto-plus==1.29.0",
        "protobuf==7.36.2", "pyarrow==26.0.1", "pyasn1==0.6.5", "pyasn1_modules==0.4.2",
        "pycparser==3.12", "pydantic==2.14.4", "pydantic_core==2.50.5", "Pygments==2.21.0",
        "python-dateutil==2.9.0.post0", "PyYAML==6.0.4", "regex==2026.11.19",
        "requests==2.34.2", "rich==15.0.0", "s3transfer==0.19.3", "safetensors==0.8.0",
        "shellingham==1.5.4", "six==1.17.0", "tiktoken==0.14.0", "tokenizers==0.22.2",
        "tqdm==4.70.1", "transformers==5.13.0", "typer==0.29.2", "typing-inspection==0.4.5",
        "typing_extensions==4.16.0", "urllib3==2.8.0", "uvloop==0.23.0", "xxhash==4.1.0",
        "yarl==1.25.1",
    ),
)  # fmt: skip

# The SGLang version whose venv `scripts/sglang_env.py` installs with `bench_serving`.
SGLANG_VERSION = "0.5.23"

# Printable ASCII (what the reference engine generates) and the newline.
_ASCII = [chr(c) for c in range(32, 127)] + ["\n"]


class ClientError(RuntimeError):
    """A client could not run or left no report; the message holds its output's tail."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload, in the tool-neutral terms both clients can express."""

    name: str
    requests: int  # at `rate`, so the run lasts requests / rate seconds
    rate: float  # requests per second, Poisson or constant as the tool does it
    input_tokens: tuple[int, int, int]  # min, mean, max
    output_tokens: tuple[int, int, int]  # min, mean, max
    prefix_groups: int = 0  # > 0: a shared-prefix workload, this many system prompts
    prefix_tokens: int = 0  # each shared system prompt


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class Result:
    """One client run against one base URL, in the tool's own figures."""

    requests: int
    errors: int
    ttft_ms: tuple[float, float]  # p50, p99
    itl_ms: tuple[float, float]  # p50, p99
    output_tok_s: float
    total_tok_s: float
    goodput_pct: float  # share of requests that met the SLO
    # Where the tool's own count of the output disagrees with the engine's `usage`:
    # inference-perf, the requests whose counts differ; bench_serving, usage's total less
    # its count of the streamed text retokenized.
    count_gap: int


@dataclass(frozen=True, slots=True)
class Job:
    """One scenario against one target: its label ("router", "direct"), base URL, the path
    its report goes to, and the engines whose prefix cache is flushed before it starts (the
    same prompts go to both targets: without a flush the second would find the first's
    prefixes cached)."""

    scenario: Scenario
    label: str
    url: str
    out: Path
    flush: tuple[str, ...]


def jobs(
    scenarios: list[Scenario], targets: dict[str, str], engines: list[str], workdir: Path
) -> list[Job]:
    """Every scenario against every target (label: base URL), in the order they run:
    each scenario's targets one after the other."""
    return [
        Job(scenario, label, url, workdir / f"{scenario.name}-{label}", tuple(engines))
        for scenario in scenarios
        for label, url in targets.items()
    ]


def flush_caches(engines: tuple[str, ...]) -> None:
    """POST each engine's `/flush_cache` (SGLang's, which the reference engine serves)."""
    for url in engines:
        request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                reply.read()
        except OSError as exc:  # URLError and HTTPError (400: requests still running)
            raise ClientError(f"flushing {url}'s cache failed: {exc}") from exc


class Client(Protocol):
    name: str

    def prepare(self) -> str:
        """Install what the client needs; returns a line saying what runs."""
        ...

    def run(
        self, todo: list[Job], model: str, slo: Slo, tokenizer: Path
    ) -> dict[tuple[str, str], Result]:
        """The jobs, one at a time: {(scenario, label): result}."""
        ...


def write_ascii_tokenizer(folder: Path) -> Path:
    """A Hugging Face fast tokenizer (`tokenizer.json`, written as data) with one token per
    printable ASCII character and no merges, special tokens or normaliser."""
    folder.mkdir(parents=True, exist_ok=True)
    model: dict[str, object] = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
        "ignore_merges": False, "vocab": {c: i for i, c in enumerate(_ASCII)}, "merges": [],
    }  # fmt: skip
    tokenizer: dict[str, object] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Fuse"}, "model": model,
    }  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000,
              "clean_up_tokenization_spaces": False}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _run(args: list[str], what: str) -> None:
    """Runs a client offline, in its own Python (none of Weir's PYTHONPATH); a failure
    raises with its output's tail.

    The client runs in a process group of its own, killed whole once its main process
    exits or the run is interrupted: inference-perf drives its load from worker processes,
    which outlived an interrupted benchmark when only the main process was killed. Its
    output goes to a file, not a pipe, so a straggler holding it cannot keep the run
    waiting."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(
            args, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.returncode != 0:
            output.seek(0)
            tail = "\n".join(output.read().strip().splitlines()[-15:])
            raise ClientError(f"{what} failed (exit {proc.returncode}):\n{tail}")


class InferencePerf:
    """kubernetes-sigs' inference-perf: one YAML config per scenario and URL (written as
    JSON, which YAML reads), its summary report read back."""

    name = "inference-perf"

    def prepare(self) -> str:
        if not INFERENCE_PERF.ready():
            print(f"weir bench live: installing inference-perf {INFERENCE_PERF.version} into "
                  f"{INFERENCE_PERF.folder} (once; minutes)", file=sys.stderr, flush=True)  # fmt: skip
        INFERENCE_PERF.ensure()
        return f"inference-perf {INFERENCE_PERF.version} ({INFERENCE_PERF.folder})"

    def run(
        self, todo: list[Job], model: str, slo: Slo, tokenizer: Path
    ) -> dict[tuple[str, str], Result]:
        results = {}
        for job in todo:
            flush_caches(job.flush)
            config = job.out / "config.yaml"
            job.out.mkdir(parents=True)
            config.write_text(json.dumps(_ip_config(job, model, slo, tokenizer)))
            _run([str(INFERENCE_PERF.bin("inference-perf")), "--config_file", str(config)],
                 f"inference-perf {job.scenario.name} against {job.url}")  # fmt: skip
            summary = json.loads((job.out / "summary_lifecycle_metrics.json").read_text())
            results[job.scenario.name, job.label] = _ip_result(summary, job.scenario)
        return results


def _distribution(bounds: tuple[int, int, int], kind: str) -> dict[str, Any]:
    low, mean, high = bounds
    return {"type": kind, "min": low, "mean": mean, "max": high,
            "std_dev": max(1, (high - low) // 4)}  # fmt: skip


def _ip_config(job: Job, model: str, slo: Slo, tokenizer: Path) -> dict[str, Any]:
    scenario = job.scenario
    data: dict[str, Any]
    if scenario.prefix_groups:
        data = {"type": "shared_prefix", "shared_prefix": {
            "num_groups": scenario.prefix_groups,
            "num_prompts_per_group": max(1, scenario.requests // scenario.prefix_groups),
            "system_prompt_len": scenario.prefix_tokens,
            "question_len": scenario.input_tokens[1], "output_len": scenario.output_tokens[1],
            "seed": 1}}  # fmt: skip
    else:
        data = {"type": "random",
                "input_distribution": _distribution(scenario.input_tokens, "lognormal"),
                "output_distribution": _distribution(scenario.output_tokens, "uniform")}  # fmt: skip
    # A constant rate for as long as the scenario's requests take at that rate.
    stage = {"rate": scenario.rate, "duration": max(1, round(scenario.requests / scenario.rate))}
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": model, "base_url": job.url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "data": data,
        # A fixed seed (its default is the clock): it seeds the random dataset's prompts
        # and lengths too, so both targets get the same requests.
        "load": {"type": "constant", "num_workers": 1, "stages": [stage], "base_seed": 1},
        "report": {
            # Output tokens as the engine's usage counts them, not the tool's retokenizing
            # of the streamed text: with a real model's tokenizer the two differ.
            "request_lifecycle": {
                "summary": True,
                "per_stage": False,
                "per_request": False,
                "use_server_output_tokens": True,
            },
            "goodput": {"constraints": {"ttft": slo.ttft_ms / 1e3, "tpot": slo.tpot_ms / 1e3}},
        },
        "storage": {"local_storage": {"path": str(job.out)}},
    }


def _ip_result(summary: dict[str, Any], scenario: Scenario) -> Result:
    ok, failed = summary["successes"], summary["failures"]
    if not ok["count"]:
        raise ClientError(f"inference-perf {scenario.name}: no request succeeded ({failed})")
    latency = ok["latency"]

    def ms(metric: str) -> tuple[float, float]:
        return latency[metric]["median"] * 1e3, latency[metric]["p99"] * 1e3

    return Result(
        requests=ok["count"] + failed["count"],
        errors=failed["count"],
        ttft_ms=ms("time_to_first_token"),
        itl_ms=ms("inter_token_latency"),
        output_tok_s=ok["throughput"]["output_tokens_per_sec"],
        total_tok_s=ok["throughput"]["total_tokens_per_sec"],
        goodput_pct=ok["goodput_metrics"]["goodput_percentage"],
        count_gap=ok["token_count_mismatches"],
    )


def sglang_python() -> Path:
    """The python of the SGLang venv that `scripts/sglang_env.py` installs."""
    return sglang_cpu.venv_python(SGLANG_VERSION)


# Run by the SGLang venv's python: `python -c DRIVER RUNS_JSON`, each run a list of engine
# URLs to flush first and bench_serving's argv. One process for
# every run, as importing bench_serving (it imports SGLang, which imports torch) takes
# longer than a small run. Its module-level import of Hugging Face `datasets`, which the
# SGLang venv does not carry and the synthetic datasets used here never call, is served
# by an import-only stand-in.
_BENCH_SERVING_DRIVER = r"""
import json
import sys
import types
import urllib.request

datasets = types.ModuleType("datasets")
def load_dataset(*args, **kwargs):
    raise NotImplementedError("datasets is not installed: Weir's import-only stand-in")
datasets.load_dataset = load_dataset
sys.modules.setdefault("datasets", datasets)

from sglang.benchmark import serving

for flush, argv in json.loads(sys.argv[1]):
    for url in flush:
        request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
        urllib.request.urlopen(request, timeout=30).read()
    sys.argv = ["bench_serving", *argv]
    serving.cli_main()
"""


class BenchServing:
    """SGLang's `bench_serving` (`sglang.benchmark.serving`) from the SGLang venv, its
    OpenAI completions client (`--backend sglang-oai`), each run's JSONL line read back."""

    name = "bench_serving"

    def prepare(self) -> str:
        reason = sglang_cpu.unavailable_reason(SGLANG_VERSION)
        if reason is not None:
            raise ToolVenvError(f"bench_serving needs SGLang's venv: {reason}")
        return f"SGLang {SGLANG_VERSION}'s bench_serving ({sglang_python()})"

    def run(
        self, todo: list[Job], model: str, slo: Slo, tokenizer: Path
    ) -> dict[tuple[str, str], Result]:
        for job in todo:
            job.out.mkdir(parents=True)
        runs = [(job.flush, _bs_argv(job, model, slo, tokenizer)) for job in todo]
        _run([str(sglang_python()), "-c", _BENCH_SERVING_DRIVER, json.dumps(runs)],
             "bench_serving")  # fmt: skip
        return {(job.scenario.name, job.label): _bs_result(job) for job in todo}


def _bs_argv(job: Job, model: str, slo: Slo, tokenizer: Path) -> list[str]:
    scenario = job.scenario
    argv = [
        "--backend", "sglang-oai", "--base-url", job.url, "--model", model,
        "--tokenizer", str(tokenizer), "--request-rate", str(scenario.rate), "--seed", "1",
        "--output-file", str(job.out / "report.jsonl"), "--disable-tqdm", "--ready-check-timeout-sec", "0",
        "--warmup-requests", "0",
        "--goodput", f"ttft:{slo.ttft_ms}", f"tpot:{slo.tpot_ms}",
    ]  # fmt: skip
    low, _, high = scenario.input_tokens
    if scenario.prefix_groups:
        return [*argv, "--dataset-name", "generated-shared-prefix",
                "--gsp-num-groups", str(scenario.prefix_groups),
                "--gsp-prompts-per-group", str(max(1, scenario.requests // scenario.prefix_groups)),
                "--gsp-system-prompt-len", str(scenario.prefix_tokens),
                "--gsp-question-len", str(scenario.input_tokens[1]),
                "--gsp-output-len", str(scenario.output_tokens[1])]  # fmt: skip
    # bench_serving's random lengths are uniform in [len * ratio, len]: the scenario's
    # maxima and the smaller of its two min/max ratios.
    ratio = min(low / high, scenario.output_tokens[0] / scenario.output_tokens[2])
    return [*argv, "--dataset-name", "random-ids", "--num-prompts", str(scenario.requests),
            "--random-input-len", str(high), "--random-output-len",
            str(scenario.output_tokens[2]), "--random-range-ratio", f"{ratio:.3f}"]  # fmt: skip


def _bs_result(job: Job) -> Result:
    scenario, out = job.scenario, job.out / "report.jsonl"
    try:
        line = json.loads(out.read_text().splitlines()[-1])
    except (OSError, IndexError, ValueError) as exc:
        raise ClientError(f"bench_serving {scenario.name} left no report in {out}") from exc
    sent = _bs_sent(scenario)
    return Result(
        requests=sent,
        errors=sent - line["completed"],
        ttft_ms=(line["median_ttft_ms"], line["p99_ttft_ms"]),
        itl_ms=(line["median_itl_ms"], line["p99_itl_ms"]),
        output_tok_s=line["output_throughput"],
        total_tok_s=line["total_throughput"],
        goodput_pct=line["slo_attainment"] * 100,
        count_gap=line["total_output_tokens"] - line["total_output_tokens_retokenized"],
    )


def _bs_sent(scenario: Scenario) -> int:
    if scenario.prefix_groups:
        return scenario.prefix_groups * max(1, scenario.requests // scenario.prefix_groups)
    return scenario.requests
