"""Installs a real SGLang server that runs on the CPU, and the tiny model it serves.

    python3 scripts/sglang_env.py 0.5.23      # or 0.5.5

Builds `${XDG_CACHE_HOME:-~/.cache}/weir/sglang/<version>/venv` (Python 3.11) with PyPI's
torch 2.14.1 (the CUDA build: it runs on the CPU), `sglang==<version>` without its declared
dependencies (most are CUDA kernels), and the exact, pinned set of packages its server
imports. SGLang's CPU backend also imports sgl-kernel's CPU ops, which no PyPI wheel
carries: an import-only stand-in `sgl_kernel` is written into the venv's site-packages
(its functions raise NotImplementedError, except `assign_req_to_token_pool_cpu`, which the
scheduler calls and which is implemented here). With no AMX ops found SGLang picks
`attention_backend=torch_native` and `sampling_backend=pytorch` and never calls the others
for a plain Llama. It also builds, offline and from a fixed seed, a tiny random-weight Llama
and a byte-level BPE tokenizer into `${XDG_CACHE_HOME:-~/.cache}/weir/sglang/tiny-llama/`.

Idempotent: a stamp keyed by a hash of everything that goes in (the pins, the stand-in, the
model recipe) makes a second run return at once. Wheels are kept in
`${XDG_CACHE_HOME:-~/.cache}/weir/sglang/wheels/` and installed from there with
`--no-index`: pip's own cache stores nothing on this kind of machine (the package index's
answers are not cacheable), so without it every venv would download torch again.

The last line on stdout is a JSON object: {"python": ..., "model": ..., "version": ...}.
Progress goes to stderr. A failure exits non-zero with the reason on stderr.

Standard library only: `tests/sglang/server.py` loads this file for its path functions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PYTHON_VERSION = (3, 11)

# torch and what it needs, the same for every SGLang version. PyPI's torch is the CUDA 13
# build; the nvidia-* wheels are what its shared libraries link against at import.
TORCH: tuple[str, ...] = (
    "torch==2.14.1",
    "torchvision==0.29.1",
    "triton==3.8.0",
    "cuda-bindings==13.5.0",
    "cuda-pathfinder==1.9.1",
    "cuda-toolkit==13.0.3.0",
    "nvidia-cublas==13.1.1.3",
    "nvidia-cuda-cupti==13.0.85",
    "nvidia-cuda-nvrtc==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cudnn-cu13==9.24.0.43",
    "nvidia-cufft==12.0.0.61",
    "nvidia-cufile==1.15.1.6",
    "nvidia-curand==10.4.0.35",
    "nvidia-cusolver==12.0.4.66",
    "nvidia-cusparse==12.6.3.3",
    "nvidia-cusparselt-cu13==0.8.1",
    "nvidia-nccl-cu13==2.30.7",
    "nvidia-nvjitlink==13.5.37",
    "nvidia-nvshmem-cu13==3.4.5",
    "nvidia-nvtx==13.0.85",
    "filelock==4.3.1",
    "fsspec==2026.9.0",
    "Jinja2==3.1.6",
    "MarkupSafe==3.0.4",
    "mpmath==1.3.0",
    "networkx==3.6.1",
    "numpy==2.4.6",
    "pillow==13.0.0",
    "sympy==1.14.0",
    "typing_extensions==4.16.0",
)

# Everything else each server imports, found by launching it and adding what was missing,
# then pinned with the versions pip resolved (the closure, so the install is `--no-deps`).
PACKAGES: dict[str, tuple[str, ...]] = {
    "0.5.23": (
        "aiohappyeyeballs==2.7.1",
        "aiohttp==3.14.5",
        "aiosignal==1.4.0",
        "annotated-doc==0.0.7",
        "annotated-types==0.8.0",
        "anyio==4.16.0",
        "apache-tvm-ffi==0.1.11",
        "asttokens==3.0.2",
        "attrs==26.1.0",
        "certifi==2026.10.19.post1",
        "cffi==2.1.1",
        "charset-normalizer==3.5.3",
        "click==8.5.1",
        "compressed-tensors==0.18.0",
        "dill==0.4.1",
        "distro==1.9.0",
        "einops==0.8.2",
        "executing==2.3.0",
        "fastapi==0.165.0",
        "frozenlist==1.8.0",
        "gguf==0.19.0",
        "h11==0.16.0",
        "hf-xet==1.8.0",
        "httpcore==1.0.9",
        "httpx==0.28.1",
        "huggingface_hub==1.33.0",
        "idna==3.20",
        "interegular==0.3.3",
        "ipython==9.18.1",
        "ipython_pygments_lexers==1.1.1",
        "jedi==0.20.1",
        "jiter==0.19.0",
        "jsonschema==4.26.0",
        "jsonschema-specifications==2025.9.1",
        "llguidance==1.9.1",
        "loguru==0.7.3",
        "markdown-it-py==4.3.0",
        "matplotlib-inline==0.2.2",
        "mdurl==0.1.2",
        "msgspec==0.23.0",
        "multidict==7.2.1",
        "openai==2.8.0",
        "opentelemetry-api==1.45.2",
        "orjson==3.13.0",
        "packaging==26.4",
        "parso==0.8.7",
        "partial-json-parser==0.2.1.1.post7",
        "pexpect==4.9.0",
        "prometheus_client==0.26.0",
        "prompt_toolkit==3.0.53",
        "propcache==0.5.4",
        "psutil==7.2.2",
        "ptyprocess==0.7.0",
        "pure_eval==0.2.4",
        "pybase64==1.5.1",
        "pycparser==3.12",
        "pydantic==2.14.4",
        "pydantic_core==2.50.5",
        "Pygments==2.21.0",
        "python-multipart==0.0.34",
        "PyYAML==6.0.4",
        "pyzmq==27.3.0",
        "referencing==0.37.0",
        "regex==2026.11.19",
        "requests==2.34.2",
        "rich==15.0.0",
        "rpds-py==2026.9.1",
        "safetensors==0.8.0",
        "scipy==1.17.1",
        "sentencepiece==0.2.1",
        "setproctitle==1.3.8",
        "shellingham==1.5.4",
        "sniffio==1.3.1",
        "soundfile==0.13.1",
        "stack-data==0.6.3",
        "starlette==1.10.0",
        "tiktoken==0.14.0",
        "tokenizers==0.23.2",
        "tqdm==4.70.1",
        "traitlets==5.16.1",
        "transformers==5.19.0",
        "typer==0.29.2",
        "typing-inspection==0.4.5",
        "urllib3==2.8.0",
        "uvicorn==0.54.0",
        "uvloop==0.23.0",
        "wcwidth==0.9.4",
        "xgrammar==0.2.7",
        "xxhash==4.1.0",
        "yarl==1.25.1",
        "zstandard==0.25.0",
    ),
    "0.5.5": (
        "aiohappyeyeballs==2.7.1",
        "aiohttp==3.14.5",
        "aiosignal==1.4.0",
        "annotated-doc==0.0.7",
        "annotated-types==0.8.0",
        "anyio==4.16.0",
        "asttokens==3.0.2",
        "attrs==26.1.0",
        "certifi==2026.10.19.post1",
        "cffi==2.1.1",
        "charset-normalizer==3.5.3",
        "click==8.5.1",
        "compressed-tensors==0.20.1",
        "dill==0.4.1",
        "distro==1.9.0",
        "einops==0.8.2",
        "executing==2.3.0",
        "fastapi==0.165.0",
        "frozenlist==1.8.0",
        "gguf==0.19.0",
        "h11==0.16.0",
        "hf-xet==1.8.0",
        "httpcore==1.0.9",
        "httpx==0.28.1",
        "huggingface_hub==0.36.2",
        "idna==3.20",
        "interegular==0.3.3",
        "ipython==9.18.1",
        "ipython_pygments_lexers==1.1.1",
        "jedi==0.20.1",
        "jiter==0.19.0",
        "jsonschema==4.26.0",
        "jsonschema-specifications==2025.9.1",
        "llguidance==0.7.30",
        "loguru==0.7.3",
        "matplotlib-inline==0.2.2",
        "msgspec==0.23.0",
        "multidict==7.2.1",
        "ninja==1.13.2",
        "openai==2.6.1",
        "openai-harmony==0.0.4",
        "opentelemetry-api==1.45.2",
        "orjson==3.13.0",
        "packaging==26.4",
        "parso==0.8.7",
        "partial-json-parser==0.2.1.1.post7",
        "pexpect==4.9.0",
        "prometheus_client==0.26.0",
        "prompt_toolkit==3.0.53",
        "propcache==0.5.4",
        "psutil==7.2.2",
        "ptyprocess==0.7.0",
        "pure_eval==0.2.4",
        "pybase64==1.5.1",
        "pycparser==3.12",
        "pydantic==2.14.4",
        "pydantic_core==2.50.5",
        "Pygments==2.21.0",
        "python-multipart==0.0.34",
        "PyYAML==6.0.4",
        "pyzmq==27.3.0",
        "referencing==0.37.0",
        "regex==2026.11.19",
        "requests==2.34.2",
        "rpds-py==2026.9.1",
        "safetensors==0.8.0",
        "scipy==1.17.1",
        "sentencepiece==0.2.3",
        "setproctitle==1.3.8",
        "sniffio==1.3.1",
        "soundfile==0.13.1",
        "stack-data==0.6.3",
        "starlette==1.10.0",
        "tiktoken==0.14.0",
        "tokenizers==0.22.2",
        "torchao==0.9.0",
        "tqdm==4.70.1",
        "traitlets==5.16.1",
        "transformers==4.57.1",
        "typing-inspection==0.4.5",
        "urllib3==2.8.0",
        "uvicorn==0.54.0",
        "uvloop==0.23.0",
        "wcwidth==0.9.4",
        "xgrammar==0.1.25",
        "yarl==1.25.1",
    ),
}

SUPPORTED = tuple(PACKAGES)

# Modules the server's processes import (the HTTP server, scheduler, detokenizer, model
# runner and the model class that serves the tiny Llama); importing them after the install
# catches a missing package before a server start would. 0.5.5's own Llama
# (`sglang.srt.models.llama`) imports vLLM's activation layers on a CPU without AMX, fails,
# and is skipped by SGLang's model registry: 0.5.5 serves the model through its Transformers
# backend (`TransformersForCausalLM`) instead.
SERVER_MODULES: dict[str, tuple[str, ...]] = {
    version: (
        "sgl_kernel",
        "sglang.launch_server",
        "sglang.srt.entrypoints.http_server",
        "sglang.srt.managers.scheduler",
        "sglang.srt.managers.detokenizer_manager",
        "sglang.srt.model_executor.model_runner",
        model,
    )
    for version, model in (
        ("0.5.23", "sglang.srt.models.llama"),
        ("0.5.5", "sglang.srt.models.transformers"),
    )
}

# The import-only sgl_kernel, written as sgl_kernel/__init__.py into the venv.
SGL_KERNEL_STANDIN = '''\
"""Import-only stand-in for sgl_kernel, written by Weir's scripts/sglang_env.py.

sgl-kernel's CPU ops ship in no PyPI wheel. SGLang's CPU backend imports a few of them at
import time and, for a plain Llama with no AMX ops found, calls only
`assign_req_to_token_pool_cpu`, implemented below. Every other name is a function that
raises NotImplementedError when called. Submodules listed in `_SUBMODULES` are served the
same way; any other submodule raises ImportError so that SGLang's own fallbacks run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__version__ = "0.0.0+weir.standin"
WEIR_STANDIN = True

_SUBMODULES: frozenset[str] = frozenset(%(submodules)r)


def _missing(qualified: str) -> Callable[..., Any]:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualified} is not available: this sgl_kernel is Weir's import-only stand-in"
        )

    unavailable.__name__ = unavailable.__qualname__ = qualified.rsplit(".", 1)[-1]
    return unavailable


def _module_getattr(module_name: str) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _missing(f"{module_name}.{name}")

    return __getattr__


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _SUBMODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """For each request i, copies its slice of the concatenated `out_cache_loc` into row
    `req_pool_indices[i]` of `req_to_token`, columns `start_offset[i]:end_offset[i]`: what
    SGLang's Triton kernel `assign_req_to_token_pool` does on a GPU."""
    del pool_len
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[taken : taken + count]
        taken += count


__getattr__ = _module_getattr(__name__)

if not any(isinstance(finder, _StandinFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _StandinFinder())
'''

# sgl_kernel submodules each version imports unconditionally on the CPU path.
STANDIN_SUBMODULES: dict[str, tuple[str, ...]] = {
    "0.5.23": (),
    "0.5.5": ("sgl_kernel.kvcacheio",),
}

# The tiny model: its recipe is data, so that its hash keys the model's stamp.
MODEL_SPEC: dict[str, object] = {
    "seed": 1234,
    "vocab_size": 512,
    "context": 4096,
    "special_tokens": ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"],
    "chat_template": (
        "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
    "corpus": [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! How are you today?",
        "Weir keeps SGLang inference fleets out of KV high water.",
        "Once upon a time there was a tiny language model.",
        "0123456789 + - * / = ( ) [ ] { } < > , . ; : ? !",
        "def main():\n    return 42\n",
        "Tokens flow from the prompt through the cache to the stream, one step at a time.",
        "A fleet of servers answers requests; the router picks the least loaded one.",
        "Pause, resume, abort, retract: every request ends in exactly one final state.",
        "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
        "The rain in Spain stays mainly in the plain. In Hartford, Hereford and Hampshire"
        " hurricanes hardly ever happen.",
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor"
        " incididunt ut labore et dolore magna aliqua.",
        "Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March"
        " April May June July August September October November December",
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"
        " rho sigma tau upsilon phi chi psi omega",
    ],
}

# Run by a venv's python (it has torch, safetensors, tokenizers and transformers):
# `python - OUT SPEC_JSON`. Every file is written from data here rather than by
# transformers' save_pretrained, whose output differs between transformers 4.x and 5.x,
# so the model is the same bytes whichever SGLang version's venv builds it.
MODEL_BUILDER = r"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

out = Path(sys.argv[1])
spec = json.loads(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)

specials = spec["special_tokens"]
bos, eos, pad = specials[:3]
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(
    vocab_size=spec["vocab_size"],
    min_frequency=1,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tokenizer.train_from_iterator(spec["corpus"], trainer=trainer)
vocab = tokenizer.get_vocab_size()
if vocab != spec["vocab_size"]:
    sys.exit(f"the tokenizer has {vocab} tokens, not {spec['vocab_size']}: add to the corpus")
tokenizer.save(str(out / "tokenizer.json"))


def write(name, data):
    (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
for key, token in zip(ids, (bos, eos, pad)):
    ids[key] = tokenizer.token_to_id(token)
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": vocab,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": spec["context"],
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
    "use_cache": True,
    **ids,
}
write("config.json", config)
write("generation_config.json", ids)
write("special_tokens_map.json", {"bos_token": bos, "eos_token": eos, "pad_token": pad})
write(
    "tokenizer_config.json",
    {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": spec["context"],
        "clean_up_tokenization_spaces": False,
        "chat_template": spec["chat_template"],
    },
)

# Random weights from a fixed seed, drawn in a fixed order.
generator = torch.Generator().manual_seed(spec["seed"])
hidden, inter, heads, kv_heads = 64, 128, 4, 2
head_dim = hidden // heads


def normal(rows, cols, std):
    return torch.randn(rows, cols, generator=generator, dtype=torch.float32) * std


tensors = {"model.embed_tokens.weight": normal(vocab, hidden, 1.0)}
for layer in range(2):
    p = f"model.layers.{layer}."
    tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
    tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, hidden**-0.5)
    tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, hidden**-0.5)
    tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, hidden**-0.5)
    tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim, hidden**-0.5)
    tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden, hidden**-0.5)
    tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden, hidden**-0.5)
    tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter, inter**-0.5)
tensors["model.norm.weight"] = torch.ones(hidden)
# Logits with a spread of a few units, so that greedy picks are not near-ties.
tensors["lm_head.weight"] = normal(vocab, hidden, 0.5)
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

# What transformers makes of it: the config loads, the tokenizer round-trips, the chat
# template renders.
loaded = LlamaConfig.from_pretrained(out)
assert loaded.vocab_size == vocab and loaded.num_key_value_heads == kv_heads, loaded
wrapped = AutoTokenizer.from_pretrained(out)
assert isinstance(wrapped, PreTrainedTokenizerFast), type(wrapped)
text = "Hello, world! The quick brown fox."
assert wrapped.decode(wrapped(text)["input_ids"]) == text
assert (wrapped.bos_token, wrapped.eos_token, wrapped.pad_token) == (bos, eos, pad)
chat = wrapped.apply_chat_template(
    [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
)
assert chat == "<|user|>hi\n<|assistant|>", repr(chat)
"""

STAMP = "weir-stamp.json"


class InstallError(RuntimeError):
    """An install step failed; the message says which and why."""


def cache_root() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/weir/sglang`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "weir" / "sglang"


def venv_dir(version: str) -> Path:
    return cache_root() / version / "venv"


def venv_python(version: str) -> Path:
    return venv_dir(version) / "bin" / "python"


def model_dir() -> Path:
    return cache_root() / "tiny-llama"


def wheel_dir() -> Path:
    return cache_root() / "wheels"


def requirements(version: str) -> list[str]:
    """The pinned list installed into the version's venv, sglang first."""
    if version not in PACKAGES:
        raise InstallError(f"unsupported SGLang version {version!r}: one of {SUPPORTED}")
    return [f"sglang=={version}", *TORCH, *PACKAGES[version]]


def standin_source(version: str) -> str:
    return SGL_KERNEL_STANDIN % {"submodules": tuple(sorted(STANDIN_SUBMODULES[version]))}


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def venv_key(version: str) -> str:
    return _digest("venv/1", version, *requirements(version), standin_source(version))


def model_key() -> str:
    return _digest("model/1", MODEL_BUILDER, json.dumps(MODEL_SPEC, sort_keys=True))


def _stamp_matches(folder: Path, key: str) -> bool:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("key") == key


def venv_ready(version: str) -> bool:
    """The version's venv is installed and matches this file's pins (no subprocess)."""
    return (
        version in PACKAGES
        and venv_python(version).is_file()
        and _stamp_matches(venv_dir(version), venv_key(version))
    )


def model_ready() -> bool:
    return (model_dir() / "model.safetensors").is_file() and _stamp_matches(
        model_dir(), model_key()
    )


def _log(message: str) -> None:
    print(f"[sglang_env] {message}", file=sys.stderr, flush=True)


def _run(args: list[str], what: str, env: dict[str, str] | None = None) -> None:
    """Runs a step, its output to stderr; raises InstallError with its tail on failure."""
    started = time.monotonic()
    done = subprocess.run(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, check=False
    )
    if done.stdout.strip():
        print(done.stdout.rstrip(), file=sys.stderr, flush=True)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        raise InstallError(f"{what} failed (exit {done.returncode}):\n{tail}")
    _log(f"{what}: {time.monotonic() - started:.1f} s")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One installer at a time per cache (tests may start several)."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _base_python() -> str:
    if sys.version_info[:2] == PYTHON_VERSION:
        return sys.executable
    name = "python{}.{}".format(*PYTHON_VERSION)
    found = shutil.which(name)
    if found is None:
        raise InstallError(f"SGLang's venv needs {name}, which is not on PATH")
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheels_present() -> set[tuple[str, str]]:
    present: set[tuple[str, str]] = set()
    for wheel in wheel_dir().glob("*.whl"):
        parts = wheel.name.split("-")
        if len(parts) >= 5:
            present.add((_canonical(parts[0]), parts[1]))
    return present


def _missing_wheels(pins: list[str]) -> list[str]:
    present = _wheels_present()
    missing = []
    for pin in pins:
        name, version = pin.split("==")
        if (_canonical(name), version) not in present:
            missing.append(pin)
    return missing


def _fill_wheelhouse(python: Path, pins: list[str]) -> None:
    missing = _missing_wheels(pins)
    if not missing:
        return
    wheel_dir().mkdir(parents=True, exist_ok=True)
    _log(f"fetching {len(missing)} wheels into {wheel_dir()}")
    _run(
        [str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir()), *missing],
        f"pip wheel ({len(missing)} packages)",
    )
    still = _missing_wheels(missing)
    if still:
        raise InstallError(f"pip wheel left no wheel for: {', '.join(still)}")


def install_venv(version: str) -> Path:
    """Builds the version's venv if its stamp is missing or stale; returns its python."""
    python = venv_python(version)
    if venv_ready(version):
        return python
    folder = venv_dir(version)
    if folder.exists():
        _log(f"removing the stale or unfinished venv {folder}")
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _run([_base_python(), "-m", "venv", str(folder)], f"python -m venv {folder}")
    pins = requirements(version)
    _fill_wheelhouse(python, pins)
    _run(
        [
            str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
            "--find-links", str(wheel_dir()), *pins,
        ],
        f"pip install ({len(pins)} packages, from {wheel_dir()})",
    )  # fmt: skip
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    standin = site / "sgl_kernel"
    standin.mkdir(exist_ok=True)
    (standin / "__init__.py").write_text(standin_source(version))
    check = "; ".join(f"import {module}" for module in SERVER_MODULES[version])
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    env.pop("PYTHONPATH", None)
    _run([str(python), "-c", check], "importing the server's modules", env=env)
    stamp = {"key": venv_key(version), "version": version, "requirements": pins}
    (folder / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return python


def build_model(python: Path) -> Path:
    """Builds the tiny model with `python` (a venv's) if its stamp is missing or stale."""
    target = model_dir()
    if model_ready():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        builder = scratch / "build_model.py"
        builder.write_text(MODEL_BUILDER)
        model = scratch / "model"
        _run(
            [str(python), str(builder), str(model), json.dumps(MODEL_SPEC)],
            "building the tiny model",
            env=env,
        )
        (model / STAMP).write_text(json.dumps({"key": model_key()}, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        model.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def ensure(version: str) -> dict[str, str]:
    """Installs what is missing; returns {"python", "model", "version"}."""
    if version not in PACKAGES:
        raise InstallError(f"unsupported SGLang version {version!r}: one of {SUPPORTED}")
    if not (venv_ready(version) and model_ready()):
        with _locked():
            python = install_venv(version)
            build_model(python)
    return {"python": str(venv_python(version)), "model": str(model_dir()), "version": version}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in PACKAGES:
        print(f"usage: sglang_env.py {{{'|'.join(SUPPORTED)}}}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        result = ensure(argv[0])
    except (InstallError, OSError, subprocess.CalledProcessError) as exc:
        print(f"sglang_env: installing SGLang {argv[0]} failed: {exc}", file=sys.stderr)
        return 1
    _log(f"ready in {time.monotonic() - started:.1f} s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
