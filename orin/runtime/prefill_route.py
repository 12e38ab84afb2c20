"""A prefill's inputs and result (`PrefillInputs`, `Prefilled`), how it runs, as one named value (`PrefillRoute`,
whose value the engine's report shows as `prefill_<route>`), the shapes that is decided on, and `choose_route`:
the one pure decision, from the prompt, what the cache holds and whether the weights stay put. Torch-free at
run time: orin.runtime.capture_policy fills the decision's inputs, orin.runtime.decode runs the route, tests drive it with ints."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PrefillInputs:
    """A prompt for StaticDecoder.prefill: embeds [T, H] (features merged), M-RoPE position_ids [3, 1, T] and
    rope_delta (generated token n is at T + n + rope_delta); `max_len`: the positions the request needs (prompt and
    answer); `record`: the HF hidden-state indices to return (0: the embeddings, i: layer i-1's output before any
    deepstack); `visual`: (the image tokens' rows [n], the first layers' deepstack features [n, H]); `bucket`: pad
    the rows to a multiple of it (None: to the graphs' buckets, where the prefill takes a graph's inputs)."""

    embeds: torch.Tensor
    position_ids: torch.Tensor
    max_len: int
    record: tuple[int, ...] = ()
    visual: tuple | None = None
    rope_delta: int = 0
    bucket: int | None = None


@dataclass
class Prefilled:
    """What a prefill gives the engine: the last position's logits [1, vocab] and normed hidden state [1, 1, H],
    and the recorded hidden states {HF index: [1, T, H]}."""

    logits: torch.Tensor
    hidden: torch.Tensor
    states: dict


class PrefillRoute(str, Enum):
    """How a prefill ran. A "graph" is a CUDA graph replayed per bucket of rows (orin.runtime.decode); deferred, a missing
    graph is captured while the GPU is idle (a server), the prompt meanwhile run eagerly on the same padded rows,
    so its results are those of the graph."""

    GRAPH = "graph"  # the whole prompt, replayed from its bucket's graph
    DEFERRED = "deferred"  # the whole prompt, eagerly on its bucket's rows (its graph not captured yet)
    EAGER = "eager"  # the whole prompt, eagerly (no graphs here, or the weights move)
    LONG = "long"  # a prompt over the long-prefill length, one layer at a time over all its rows
    REUSED = "reused"  # a next turn: its shared rows read from the cache, the rest eagerly
    REUSED_GRAPH = "reused_graph"  # ... the rest replayed from its bucket's graph
    REUSED_DEFERRED = "reused_deferred"  # ... the rest eagerly on its bucket's rows (graph not captured yet)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def continued(self) -> bool:
        """Whether the prompt's leading rows were read from the cache (a conversation's next turn)."""
        return self in (PrefillRoute.REUSED, PrefillRoute.REUSED_GRAPH, PrefillRoute.REUSED_DEFERRED)

    @property
    def graph_shaped(self) -> bool:
        """Whether the rows took a graph's inputs (padded to its bucket), replayed or deferred."""
        return self in (PrefillRoute.GRAPH, PrefillRoute.DEFERRED, PrefillRoute.REUSED_GRAPH,
                        PrefillRoute.REUSED_DEFERRED)

    @property
    def replayed(self) -> bool:
        return self in (PrefillRoute.GRAPH, PrefillRoute.REUSED_GRAPH)


def prefill_bucket(tokens: int) -> int:
    """The rows a graph prefill of `tokens` is padded to: multiples of 64 up to 512, then eight buckets per
    doubling (at most a quarter more rows than the prompt; padding rows skip the MoE, most of the work): twenty
    buckets up to 4,096 rows, where a bucket of every 64 made sixty-four, and as many captures."""
    step = 64 if tokens <= 512 else (1 << (tokens - 1).bit_length()) // 8
    return -(-tokens // step) * step


@dataclass(frozen=True)
class GraphKey:
    """A prefill graph: the rows it takes, the hidden states it records, the deepstack levels it takes as one
    static input (0: none) and whether it is a continued prefill's (`after`: the rows after those the cache
    holds, whose cache positions and mask are inputs, so one capture serves any prefix)."""

    rows: int
    record: tuple[int, ...] = ()
    deepstack: int = 0
    after: bool = False


@dataclass(frozen=True)
class PromptShape:
    """What a route depends on in a prompt: its rows, the hidden states it records, its deepstack levels (0:
    none) and a row multiple the caller pads it to (None: the bucket's, where it takes a graph's inputs)."""

    rows: int
    record: tuple[int, ...] = ()
    deepstack: int = 0
    pad_to: int | None = None


@dataclass(frozen=True)
class Route:
    """A prefill's route and what it runs: `rows` computed after the `shared` ones the cache holds, padded to
    `padded`, through (or padded for) the graph `key`; `grows`: the cache is reallocated first (its graphs go)."""

    kind: PrefillRoute
    rows: int
    padded: int
    shared: int = 0
    key: GraphKey | None = None
    grows: bool = False


def choose_route(rows: int, shared: int, *, graph: bool, captured: bool, defer: bool,
                 long_tokens: int) -> PrefillRoute:
    """The route of a prefill of `rows`, `shared` of them read from the cache (0: a whole prefill). `graph`: the
    rows may go through a graph (graphs run here, the weights stay put, the MoE has no host sync, the bucket fits
    the cache and the mask limit); `captured`: that graph exists (and outlives the prefill's cache); `defer`: a
    missing graph is captured while idle, not by this prefill."""
    if shared:
        if not graph:
            return PrefillRoute.REUSED
        return PrefillRoute.REUSED_DEFERRED if defer and not captured else PrefillRoute.REUSED_GRAPH
    if graph:
        return PrefillRoute.DEFERRED if defer and not captured else PrefillRoute.GRAPH
    return PrefillRoute.LONG if rows > long_tokens else PrefillRoute.EAGER


__all__ = ["GraphKey", "PrefillInputs", "PrefillRoute", "Prefilled", "PromptShape", "Route", "choose_route",
           "prefill_bucket"]
