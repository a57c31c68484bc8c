"""How long one engine iteration takes: a roofline over the batch's work.

An iteration reads the weights once and the KV of every sequence it attends over, and does
2·params FLOPs per new token plus attention FLOPs proportional to the context each new token
sees. Its time is a fixed launch/scheduling overhead plus the larger of the compute time and
the memory time, each at an achievable fraction of the hardware's peak. Small decode batches
are memory bound (weights + KV reads), large prefills compute bound, as on real GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    params: float
    layers: int
    hidden: int
    kv_bytes_per_token: int
    context_length: int
    bytes_per_param: float = 2.0


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    flops: float
    hbm_bytes_per_s: float
    hbm_capacity_bytes: float
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    fixed_overhead_s: float = 0.003
    mem_fraction_static: float = 0.88
    # Device-host copies (HiCache): PCIe Gen5 x16 as achieved, of its 64 GB/s.
    host_bytes_per_s: float = 50e9
    # Prefill->decode KV transfer for one request (P/D): one 400 Gb/s NDR InfiniBand or
    # RoCE NIC per H200 (a DGX/HGX H200 node has eight ConnectX-7 for eight GPUs), what
    # Mooncake's transfer engine and NIXL move between nodes. A 20K-token prompt of the
    # 70B model (6.6 GB of KV) takes about 0.13 s.
    kv_link_bytes_per_s: float = 50e9


# Llama-3.1-8B: 32 layers, 8 KV heads of 128 dims, bf16 K and V.
LLAMA_8B = ModelProfile(
    name="llama-3.1-8b",
    params=8.03e9,
    layers=32,
    hidden=4096,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    context_length=131072,
)

H200 = HardwareProfile(
    name="h200",
    flops=989e12,
    hbm_bytes_per_s=4.8e12,
    hbm_capacity_bytes=141e9,
)


@dataclass(frozen=True, slots=True)
class TimingModel:
    model: ModelProfile = LLAMA_8B
    hardware: HardwareProfile = H200

    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit beside the weights in the static memory fraction, as SGLang
        sizes its pool (a few GB kept back for activations)."""
        budget = (
            self.hardware.hbm_capacity_bytes * self.hardware.mem_fraction_static
            - self.model.params * self.model.bytes_per_param
            - 4e9
        )
        return max(1, int(budget // self.model.kv_bytes_per_token))

    def kv_transfer_s(self, tokens: int, link_bytes_per_s: float | None = None) -> float:
        """Seconds to ship `tokens` tokens of KV from a prefill engine to a decode engine
        (P/D) over the hardware's link, or one of `link_bytes_per_s`."""
        link = link_bytes_per_s or self.hardware.kv_link_bytes_per_s
        return tokens * self.model.kv_bytes_per_token / link

    def host_transfer_s(self, tokens: int) -> float:
        """Seconds to copy `tokens` tokens of KV between device and host memory."""
        return tokens * self.model.kv_bytes_per_token / self.hardware.host_bytes_per_s

    def iteration_s(
        self,
        prefill_tokens: int,
        prefill_pairs: int,
        prefill_context: int,
        decode_seqs: int,
        decode_context: int,
    ) -> float:
        """Seconds for one iteration.

        prefill_tokens: new prompt tokens computed; prefill_pairs: Σ over them of the
        context each attends to; prefill_context: cached/earlier KV tokens the prefill chunks
        read; decode_seqs: sequences decoding one token each; decode_context: their KV
        tokens, all read once.
        """
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        model, hw = self.model, self.hardware
        new_tokens = prefill_tokens + decode_seqs
        flops = 2.0 * model.params * new_tokens + 4.0 * model.layers * model.hidden * (
            prefill_pairs + decode_context
        )
        memory = model.params * model.bytes_per_param + model.kv_bytes_per_token * (
            prefill_context + decode_context + new_tokens
        )
        compute_s = flops / (hw.flops * hw.compute_efficiency)
        memory_s = memory / (hw.hbm_bytes_per_s * hw.memory_efficiency)
        return hw.fixed_overhead_s + max(compute_s, memory_s)

    def prefill_stop(
        self, start: int, tokens: int, pairs: int, context: int, budget_s: float
    ) -> float:
        """About the furthest a prefill chunk from position `start` may run (its end),
        beside `tokens` other prefill tokens (`pairs` attention pairs, `context` KV read),
        for its iteration to take at most `budget_s`: `iteration_s`'s roofline solved in
        closed form, so rounding may put it a token off either way (the caller checks its
        neighbours with `iteration_s`)."""
        model, hw = self.model, self.hardware
        left_s = budget_s - hw.fixed_overhead_s
        # Memory: weights + KV (context + start + tokens + stop - start) within the budget.
        kv = model.kv_bytes_per_token
        weights = model.params * model.bytes_per_param
        by_memory = (left_s * hw.hbm_bytes_per_s * hw.memory_efficiency - weights) / kv
        by_memory -= context + tokens
        # Compute: 2·params per new token and 4·layers·hidden per pair, the chunk's pairs
        # being Σ (start, stop] = (stop² + stop - start² - start) / 2.
        pair = 2.0 * model.layers * model.hidden  # half the FLOPs of a pair
        per_token = 2.0 * model.params
        b = per_token + pair
        c = per_token * (tokens - start) + 2.0 * pair * pairs - pair * start * (start + 1)
        c -= left_s * hw.flops * hw.compute_efficiency
        discriminant = b * b - 4.0 * pair * c
        if discriminant < 0:
            return float(start)
        by_compute = (-b + math.sqrt(discriminant)) / (2.0 * pair)
        return min(by_memory, by_compute)

    def decode_run_s(
        self, seqs: int, context: int, steps: int, start: float, until: float
    ) -> list[float]:
        """The durations of up to `steps` decode-only iterations in a row from `start`,
        `seqs` sequences each, the first reading `context` KV tokens (each reads `seqs`
        more than the one before), stopping after the first that ends at or after
        `until`: `iteration_s(0, 0, 0, seqs, context)` for each, to the last bit (the
        same operations in the same order, the constant ones taken out of the loop)."""
        model, hw = self.model, self.hardware
        token_flops = 2.0 * model.params * seqs
        pair_flops = 4.0 * model.layers * model.hidden
        weights = model.params * model.bytes_per_param
        kv_bytes = model.kv_bytes_per_token
        flops_per_s = hw.flops * hw.compute_efficiency
        bytes_per_s = hw.hbm_bytes_per_s * hw.memory_efficiency
        overhead = hw.fixed_overhead_s
        durations: list[float] = []
        end = start
        for _ in range(steps):
            compute_s = (token_flops + pair_flops * context) / flops_per_s
            memory_s = (weights + kv_bytes * (context + seqs)) / bytes_per_s
            duration = overhead + max(compute_s, memory_s)
            durations.append(duration)
            context += seqs
            end += duration
            if end >= until:
                break
        return durations
