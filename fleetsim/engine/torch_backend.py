"""A tiny transformer (random weights, greedy) computing real attention over the paged KV
cache, to prove the scheduler's paging, prefix sharing and recompute are right: the tokens
it generates through the engine must equal a plain dense forward pass over the same text.

Layout: K and V live in one tensor per kind, `[layers, pages, page_size, heads, head_dim]`;
a request's token at position p is at page `page_table[p // page_size]`, slot
`p % page_size`. A prefix-cache hit reuses pages another request wrote: same tokens at the
same positions give the same K and V, so nothing is recomputed. Outputs are restricted to
printable ASCII (and EOS), as the hash backend's are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from fleetsim.engine.config import EngineConfig
from fleetsim.engine.request import EngineRequest
from fleetsim.engine.tokens import EOS_ID, VOCAB_SIZE

_PRINTABLE = list(range(32, 127))

KVWriter = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, k, v) of new tokens
KVReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (layer, end) -> k, v


class TinyTransformer(torch.nn.Module):
    def __init__(self, layers: int = 2, dim: int = 64, heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers, self.dim, self.heads = layers, dim, heads
        self.head_dim = dim // heads

        def weight(*shape: int) -> torch.nn.Parameter:
            scale = 1.0 / math.sqrt(shape[0])
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * scale, False)

        self.embed = weight(VOCAB_SIZE, dim)
        self.qkv = torch.nn.ParameterList([weight(dim, 3 * dim) for _ in range(layers)])
        self.out = torch.nn.ParameterList([weight(dim, dim) for _ in range(layers)])
        self.up = torch.nn.ParameterList([weight(dim, 4 * dim) for _ in range(layers)])
        self.down = torch.nn.ParameterList([weight(4 * dim, dim) for _ in range(layers)])
        self.unembed = weight(dim, VOCAB_SIZE)

    def positions(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.float32)[:, None]
        freq = torch.exp(
            torch.arange(0, self.dim, 2, dtype=torch.float32) * (-math.log(10000.0) / self.dim)
        )
        enc = torch.zeros(end - start, self.dim)
        enc[:, 0::2] = torch.sin(pos * freq)
        enc[:, 1::2] = torch.cos(pos * freq)
        return enc

    def forward_chunk(
        self,
        ids: Sequence[int],
        start: int,
        write_kv: KVWriter,
        read_kv: KVReader,
    ) -> torch.Tensor:
        """Hidden states of tokens `ids` at positions start.. given earlier KV via
        `read_kv(layer, end) -> (k, v)` after `write_kv(layer, k_new, v_new)`."""
        n = len(ids)
        end = start + n
        x = self.embed[torch.tensor(list(ids))] + self.positions(start, end)
        causal = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
        for layer in range(self.layers):
            h = torch.nn.functional.layer_norm(x, (self.dim,))
            q, k, v = (h @ self.qkv[layer]).split(self.dim, dim=-1)
            shape = (n, self.heads, self.head_dim)
            write_kv(layer, k.reshape(shape), v.reshape(shape))
            keys, values = read_kv(layer, end)
            scores = torch.einsum("qhd,khd->hqk", q.reshape(shape), keys) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~causal, float("-inf"))
            att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, self.dim)
            x = x + att @ self.out[layer]
            h = torch.nn.functional.layer_norm(x, (self.dim,))
            x = x + torch.nn.functional.gelu(h @ self.up[layer]) @ self.down[layer]
        return torch.nn.functional.layer_norm(x, (self.dim,))

    def next_token(self, hidden: torch.Tensor, eos_allowed: bool) -> int:
        logits = hidden @ self.unembed
        allowed = _PRINTABLE + ([EOS_ID] if eos_allowed else [])
        best = int(torch.argmax(logits[allowed]))
        return allowed[best]

    @torch.no_grad()
    def generate_dense(self, ids: Sequence[int], count: int, ignore_eos: bool = True) -> list[int]:
        """Greedy tokens by a plain forward over the whole sequence each time (no cache):
        the reference the paged backend must match."""
        seq = list(ids)
        out: list[int] = []
        for _ in range(count):
            token = self.next_token(self._dense_last(seq), not ignore_eos)
            out.append(token)
            if token == EOS_ID:
                break
            seq.append(token)
        return out

    def _dense_last(self, seq: Sequence[int]) -> torch.Tensor:
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            kv.append((k, v))

        def read(layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            return kv[layer]

        return self.forward_chunk(seq, 0, write, read)[-1]


class TorchBackend:
    """The tiny transformer over the engine's page tables."""

    def __init__(
        self, config: EngineConfig, layers: int = 2, dim: int = 64, heads: int = 4
    ) -> None:
        torch.set_num_threads(1)
        self.model = TinyTransformer(layers, dim, heads, seed=config.seed)
        self.page_size = config.page_size
        pages = config.total_tokens // config.page_size
        shape = (layers, pages, config.page_size, heads, dim // heads)
        # Uninitialised: attention only ever reads positions a prefill or decode wrote, so
        # a large pool costs address space, not memory.
        self.k = torch.empty(shape)
        self.v = torch.empty(shape)

    def _slots(self, req: EngineRequest, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(req.page_table(), dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.page_size], pos % self.page_size

    @torch.no_grad()
    def prefill(self, request: EngineRequest, start: int, end: int) -> int | None:
        ids = request.history()[start:end]
        pages, slots = self._slots(request, start, end)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer, pages, slots] = k
            self.v[layer, pages, slots] = v

        def read(layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
            all_pages, all_slots = self._slots(request, 0, upto)
            return self.k[layer, all_pages, all_slots], self.v[layer, all_pages, all_slots]

        hidden = self.model.forward_chunk(ids, start, write, read)
        if end < request.total_len:
            return None
        return self.model.next_token(hidden[-1], not request.eos_suppressed)

    def decode(self, batch: Sequence[EngineRequest]) -> list[int]:
        tokens = []
        for req in batch:
            token = self.prefill(req, req.computed, req.computed + 1)
            assert token is not None
            tokens.append(token)
        return tokens
