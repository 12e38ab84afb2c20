"""Which prefill graphs a decoder wants, captures, defers and drops, and how large its cache grows ahead: pure
decisions over row counts, buckets and cache sizes (no torch). orin.runtime.decode keeps the tensors (caches, graphs,
their inputs) and asks a `CapturePolicy` at each step: the route of a prefill, what it leaves to capture, what
to capture next while the GPU is idle, what to release.

A server defers its captures (`defer`): a prefill whose graph is missing runs eagerly and the graph is captured in
the idle time between requests (orin.serve's spare turn), which ends as soon as a request waits. So the order
matters: what the next request most likely needs comes first. After a conversation's turn the next turn's new
rows are known (`turn_ended`: the answer and a question like the last); the idle time first grows the cache to
what that turn needs (a grown cache drops every graph that read the old one), then captures that turn's bucket
over it, then the rest. docs/architecture.md says more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..device.profile import DeviceProfile
from .prefill_route import GraphKey, PrefillRoute, PromptShape, Route, choose_route, prefill_bucket


@dataclass(frozen=True)
class _Turn:
    """A conversation's last prefill, for turn_ended: its graph's recorded states, its prompt's rows (the next
    turn's shared ones) and the positions it asked beyond them (its answer's)."""

    record: tuple[int, ...]
    rows: int
    new_tokens: int


class CapturePolicy:
    """One decoder's capture decisions. `graphs`: prefills may take graphs at all (CUDA with INT4 experts, or the
    profile's capture.cpu_graph_path); `heads_per_kv`: mask rows per prompt row of a continued prefill's graph."""

    def __init__(self, profile: DeviceProfile, *, graphs: bool, heads_per_kv: int = 1):
        self.tuning = profile.capture
        self.memory = profile.memory
        self.long_tokens = profile.prefill.long_prefill_tokens
        self.graphs = graphs
        self.heads_per_kv = heads_per_kv
        self.defer = False  # a server's: missing graphs are captured while idle (capture_deferred)
        self._captured: dict[GraphKey, None] = {}  # the graphs kept, least recently used first
        self._wanted: list[GraphKey] = []  # to capture while idle, the next first
        self._next: tuple[GraphKey, ...] = ()  # what the next prefill most likely replays, likeliest first
        self._need = 0  # the positions the last prefill needed
        self._next_need = 0  # the positions a conversation's predicted next turn needs (turn_ended)
        self._last_rows = 0  # the last prompt's rows, and by how much they grew over the one before
        self._growth = 0
        self._turn: _Turn | None = None

    # ------------------------------------------------------------------ sizes

    def cache_positions(self, n: int) -> int:
        return self.memory.cache_positions(n)

    def after_fits(self, rows: int, cache: int) -> bool:
        """Whether a continued prefill's graph of `rows` over a `cache`-position cache keeps its mask (one row per
        query head of a KV group and prompt row, one column per position) under the limit."""
        return self.heads_per_kv * rows * cache <= self.tuning.after_mask_max

    def reusable(self, shared: int, rows: int) -> int:
        """`shared` (the leading rows of a `rows`-row prompt the cache holds), or 0 where too few to be worth
        reading or where the rest is a long prompt (the whole goes its layer-major way)."""
        return shared if shared >= self.tuning.reuse_min_rows and rows - shared <= self.long_tokens else 0

    def may_hold(self, nbytes: int) -> bool:
        """Whether a prompt whose holding keeps `nbytes` alive is held for a next turn."""
        return nbytes <= self.tuning.held_max_bytes

    # ------------------------------------------------------------------ routes

    def route(self, prompt: PromptShape, shared: int, *, stays: bool, capturable: bool, cache: int,
              need: int) -> Route:
        """The route of a prefill (choose_route's decision, with its graph key): `shared` leading rows read from
        the cache (reusable's answer; 0: whole), `stays`: the weights stay put (a capture is replayed more than
        once), `capturable`: its MoE runs without a host sync, `cache`: the cache's positions now (0: none),
        `need`: the positions the request needs (its prompt and answer)."""
        graphs = self.graphs and capturable
        if shared:
            rows = prompt.rows - shared
            bucket = prefill_bucket(rows)
            graph = graphs and shared + bucket <= cache and self.after_fits(bucket, cache)
            padded, grows = (bucket if graph else rows), False
            key = GraphKey(bucket, prompt.record, prompt.deepstack, after=True) if graph else None
        else:
            rows = prompt.rows
            graph = graphs and stays and rows <= self.long_tokens
            padded = (-(-rows // prompt.pad_to) * prompt.pad_to if prompt.pad_to
                      else prefill_bucket(rows) if graph else rows)
            grows = not cache or max(need, padded, rows + 1) > cache
            key = GraphKey(padded, prompt.record, prompt.deepstack) if graph else None
        captured = key in self._captured and not grows
        kind = choose_route(rows, shared, graph=graph, captured=captured, defer=self.defer,
                            long_tokens=self.long_tokens)
        return Route(kind, rows, padded, shared, key, grows)

    def prefilled(self, route: Route, need: int, cache: int, continues: bool) -> None:
        """After a prefill by `route` (needing `need` positions, the cache now `cache`): what it leaves to capture
        while idle, where deferred (its own bucket and those of the prompts likely next), and, for a conversation,
        what turn_ended needs."""
        rows = route.shared + route.rows
        self._growth, self._last_rows = (rows - self._last_rows if 0 < self._last_rows < rows else 0), rows
        self._need = max(need, route.shared + route.padded) if route.kind.continued else max(need, route.padded,
                                                                                            rows + 1)
        self._next, self._next_need, self._turn = (), 0, None
        if not self.defer or route.key is None:
            return
        key = route.key
        if route.kind is PrefillRoute.DEFERRED:
            self._want(self._ahead(rows, key), cache)
        elif route.kind is PrefillRoute.REUSED_DEFERRED:
            self._want(self._after(route.rows, key), cache)
        if continues and (not key.after or not key.deepstack):
            if not key.after:  # a first turn: a next one about as long as itself, until its answer is done
                self._want(self._after(rows, GraphKey(key.rows, key.record, after=True)), cache)
            self._turn = _Turn(key.record, rows, need - rows)

    def turn_ended(self, next_rows: int, cache: int) -> None:
        """A conversation's answer is done (once a turn): the next turn will prefill about `next_rows` new rows
        after this prompt's (the answer and a question like the last). Its buckets, over the cache that turn will
        have, come first; the guesses made at the prefill, when only the prompt was known, are dropped."""
        turn, self._turn = self._turn, None
        if turn is None or not self.defer:
            return
        first = prefill_bucket(next_rows)
        buckets = self._order(next_rows, next_rows + self.tuning.lookahead // 2, first)
        self._next_need = turn.rows + max(next_rows + turn.new_tokens, max(buckets))
        size = max(cache, self.cache_positions(self._next_need))
        keys = [GraphKey(b, turn.record, after=True) for b in buckets
                if b <= self.long_tokens and self.after_fits(b, size)]
        self._wanted = [k for k in self._wanted if not k.after or k in keys]
        self._want(keys, size)

    def expect(self, lo: int, hi: int, record: tuple[int, ...], answer: int, cache: int) -> None:
        """A conversation is about to start (a Realtime session, on its creation and on each change of its
        instructions): its first prompt will be `lo` to `hi` rows (the instructions and a question of a few seconds;
        the server warm-up's lookahead does not reach a long system prompt's), its answer up to `answer` tokens.
        Their whole-prompt buckets are captured first while idle, over a cache grown to hold them."""
        if not self.defer or not self.graphs:
            return
        hi = min(hi, self.long_tokens)
        keys = [GraphKey(b, record) for b in self._order(lo, hi, prefill_bucket(lo)) if b <= self.long_tokens]
        self._next_need = max(self._next_need, max((k.rows for k in keys), default=0), hi + answer)
        self._want(keys, max(cache, self.cache_positions(self._next_need)))

    # ------------------------------------------------------------------ idle time

    def wanted(self) -> tuple[GraphKey, ...]:
        """The graphs capture_deferred would capture, in its order."""
        return tuple(self._wanted)

    def grow_to(self, cache: int, stepped: bool) -> int | None:
        """The cache size to grow to while idle, ahead of the next prompts, when the cache is smaller: the last
        prompt's need and the lookahead, and a conversation's predicted next turn. None: no growth (nothing to
        grow, or no decode step has run to tell how the step graph is captured again)."""
        if not self.defer or not cache or not stepped:
            return None
        size = self.cache_positions(max(self._need + self._lookahead(), self._next_need))
        return size if size > cache else None

    def pending(self, cache: int, stepped: bool) -> int:
        """Captures capture_deferred would make now (a growth re-captures the decode step)."""
        return len(self._wanted) + (self.grow_to(cache, stepped) is not None)

    def next_capture(self, cache: int) -> GraphKey | None:
        """The next graph to capture over a `cache`-position cache (taken off the wanted ones), or None."""
        while self._wanted:
            key = self._wanted.pop(0)
            if key not in self._captured and key.rows <= cache and (not key.after or self.after_fits(key.rows, cache)):
                return key
        return None

    # ------------------------------------------------------------------ the graphs kept

    def is_captured(self, key: GraphKey) -> bool:
        return key in self._captured

    def captured(self) -> tuple[GraphKey, ...]:
        """The graphs kept, least recently used first."""
        return tuple(self._captured)

    def admit(self, key: GraphKey) -> list[GraphKey]:
        """A graph is captured for `key`: the graphs to release first (least recently used, past the number
        kept)."""
        drop = []
        while len(self._captured) >= self.tuning.prefill_graphs:
            oldest = next(iter(self._captured))
            del self._captured[oldest]
            drop.append(oldest)
        self._captured[key] = None
        return drop

    def used(self, key: GraphKey) -> None:
        """`key`'s graph was replayed: the last to be dropped."""
        self._captured.pop(key, None)
        self._captured[key] = None

    def failed(self, key: GraphKey) -> None:
        """`key`'s capture failed: no graph is kept for it."""
        self._captured.pop(key, None)

    def released(self) -> None:
        """Every graph was released with the cache it read (a new cache, or the decoder released). Deferred,
        they are captured again while idle: those the next prefill likely replays first, the rest after what is
        wanted already, the most recently used first."""
        gone = list(reversed(self._captured))
        self._captured.clear()
        if self.defer:
            first = list(self._next)
            rest = [k for k in self._wanted if k not in first]
            self._wanted = first + rest + [k for k in gone if k not in first and k not in rest]
        self._trim()

    def forget(self) -> None:
        """Forget what was learnt of the prompts seen (wanted graphs, growth, a conversation's turn)."""
        self._wanted, self._next, self._turn = [], (), None
        self._need = self._next_need = self._last_rows = self._growth = 0

    # ------------------------------------------------------------------ internals

    def _lookahead(self) -> int:
        return min(self.tuning.lookahead_max, max(self.tuning.lookahead, self._growth * 3 // 2))

    def _order(self, lo: int, hi: int, first: int) -> list[int]:
        """The buckets of prompts of `lo` to `hi` rows, nearest to `first` first."""
        return sorted({prefill_bucket(n) for n in (*range(lo, hi, 64), hi)}, key=lambda b: (abs(b - first), b))

    def _ahead(self, rows: int, key: GraphKey) -> list[GraphKey]:
        """A whole prompt's bucket and those of the prompts likely next: up to the lookahead longer, or, where
        prompts have been growing, around the next one's predicted length (this one plus the last growth), whose
        bucket then comes first and this one's (a repeat) last."""
        growth = self._growth
        nearest = prefill_bucket(min(rows + growth, self.long_tokens))
        ahead = [b for b in self._order(rows + growth // 2, rows + self._lookahead(), nearest) if b != key.rows]
        buckets = [*ahead, key.rows] if growth else [key.rows, *ahead]
        return [replace(key, rows=b) for b in buckets if b <= self.long_tokens]

    def _after(self, rows: int, key: GraphKey) -> list[GraphKey]:
        """A continued prefill's bucket and the next ones up (a conversation's turns add about as many rows
        each time)."""
        ahead = [b for b in self._order(rows, rows + self.tuning.lookahead // 2, key.rows) if b != key.rows]
        return [replace(key, rows=b) for b in (key.rows, *ahead) if b <= self.long_tokens]

    def _want(self, keys: list[GraphKey], cache: int) -> None:
        """Capture `keys` first (in their order) while idle; they are what the next prefill most likely needs."""
        keys = [k for k in keys if not k.after or self.after_fits(k.rows, cache)]
        self._next = tuple(keys)
        fresh = [k for k in keys if k not in self._captured]
        self._wanted = fresh + [k for k in self._wanted if k not in fresh]
        self._trim()

    def _trim(self) -> None:
        # more than the graphs kept would have the idle captures evict each other
        del self._wanted[self.tuning.prefill_graphs // 2:]


__all__ = ["CapturePolicy"]
