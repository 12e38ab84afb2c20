"""Prefill and decoding with static KV caches, one position per decode call, captured in CUDA graphs: the
thinker, the talker and the talker's code predictor.

Decoding one token through the HF modules with a dynamic cache costs thousands of kernel launches and a host
sync per MoE layer (the per-expert token counts); at batch 1 the GPU waits on Python. Here every layer is
orin.decoder_layer's pure function, on every device: this is the engine's only decode path, and the HF modules
are only the oracle the tests compare against.

The prompt goes through the same layer function (`StaticDecoder.prefill`): causal attention over the new keys,
which are written straight into the static caches; the MoE through the experts module's grouped path (one Triton
launch per projection, no host sync); dense INT4 layers dequantized for one cuBLAS GEMM. Where the weights stay
put, the whole prefill is replayed from a CUDA graph per prompt-length bucket: eager, its ~5,000 launches made the
host, not the GPU, set the time to first token.

On CUDA each decoder step is captured once per weight placement and replayed per position (orin.graph_runner).
With `compile=True` the layer function goes through torch.compile first (one compilation per layer shape, shared
by all layers), fusing the elementwise work between the matmuls; if that fails the plain function is captured.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import components as C
from .decoder_layer import (
    attention_block,
    attention_block_long,
    cudnn_whole_prompt,
    decoder_layer,
    layer_weights,
    mlp_block_long,
    supported,
)
from .errors import ModelError
from .graph_runner import GraphRunner

PREFILL_GRAPHS = 16  # captured prefill buckets kept per decoder, least recently used dropped first
# Deferred captures (a server's decoders) also cover the buckets of prompts up to this many tokens longer than
# the one just seen (a conversation's next prompt is its last plus an answer and a question), or, where prompts
# have been growing, up to one and a half times the last growth, at most PREFILL_LOOKAHEAD_MAX.
PREFILL_LOOKAHEAD = 256
PREFILL_LOOKAHEAD_MAX = 2048
# A prefill graph's capture runs its function once first (on a side stream: library handles, workspaces), not
# three times as a decode step's does: a bucket's kernels are those of the buckets before it, and at 2,000 rows
# each pass is a fifth of a second of idle time.
PREFILL_CAPTURE_WARMUPS = 1
# The rows of each graph-prefill input that grow with the bucket (the rest: `last`, one index).
_ROW_DIM = {"x": 0, "cos": 0, "sin": 0, "valid": 0, "ds": 1, "pos": 0, "mask": 2}
# The last element of a continued prefill's bucket key (StaticDecoder._prefill_after).
AFTER = "after"
# A continued prefill replays a graph only where its mask (one row per query head of a KV group and new row, one
# column per cache position) has at most this many elements: SDPA turns it into a bias of the activations' dtype,
# kept in the graphs' pool. A voice turn's ~600 rows over a 3,072-position cache are 15.7M; a long new message
# over a long conversation goes the eager way, whose flash kernel needs no mask.
AFTER_MASK_MAX = 1 << 25
# A conversation's next turn (GenerationRequest.continues) reads its prompt's prefix from the cache where the last
# prompt left it: at least this many rows, or it is prefilled whole.
REUSE_MIN_ROWS = 64
# The most a prompt held for a next turn may keep alive between requests (any prompt where the weights stay put:
# a conversation's first turn does not know it is one): its embeddings, recorded hidden states and deepstack
# features. Inside the plan's runtime margin; about 10,000 text or audio tokens of the real thinker.
HELD_MAX_BYTES = 128 << 20


def _specs(inputs: dict) -> dict:
    """A graph prefill's inputs as (shape, dtype): what capture_deferred() rebuilds them from."""
    return {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()}


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A tensor's shape and dtype without its memory (what _want reads)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def prefill_bucket(tokens: int) -> int:
    """The rows a graph prefill of `tokens` is padded to: multiples of 64 up to 512, then eight buckets per
    doubling (at most a quarter more rows than the prompt; padding rows skip the MoE, most of the work). Twenty
    buckets up to LONG_PREFILL_TOKENS, where a bucket of every 64 made sixty-four, and as many captures."""
    step = 64 if tokens <= 512 else (1 << (tokens - 1).bit_length()) // 8
    return -(-tokens // step) * step


# ---------------------------------------------------------------------- thinker and talker


def _int4_experts_only(text_model) -> bool:
    """Whether every MoE layer's experts are INT4: BF16 experts (a checkpoint that keeps them) run through their
    module, whose per-expert token counts are a host sync no CUDA graph can hold."""
    from .int4 import Int4Experts

    return all(isinstance(layer.mlp.experts, Int4Experts) for layer in text_model.layers if hasattr(layer.mlp, "experts"))


@dataclass
class _Held:
    """What the caches' first rows hold, for a conversation's next turn to read instead of computing: the prompt
    that wrote them (its embeddings [n, H], M-RoPE positions [3, 1, n] and deepstack rows and levels) and the
    hidden states its prefill recorded {HF index: [n, H]}."""

    embeds: torch.Tensor
    position_ids: torch.Tensor
    visual: tuple | None
    states: dict


@dataclass
class Prefilled:
    """What a prefill gives the engine: the last position's logits [1, vocab] and normed hidden state
    [1, 1, H], and the recorded hidden states {HF index: [1, T, H]}."""

    logits: torch.Tensor
    hidden: torch.Tensor
    states: dict


class StaticDecoder:
    """Static-cache decoding of one sequence: `prefill(embeds, positions, max_len)`, then `step(token)` (thinker:
    returns logits [1, vocab]) or `step_embeds(embeds)` (talker: returns (logits, last hidden))."""

    def __init__(self, text_model, head, device: torch.device, compile: bool = False, widen: int = 1):
        """`widen`: how many times the thinker's rows a long prompt's chunk and MoE blocks take here (a decoder
        of half the thinker's width: twice the rows, the same bytes; orin.components.long_prefill_widen)."""
        self.model, self.head = text_model, head
        self.cfg = text_model.config
        self.device = device
        self.widen = widen
        self.runner = GraphRunner(device, device.type == "cuda" and _int4_experts_only(text_model), compile)
        self.max_len = 0
        self.length = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # bucket key -> (its runner, its graph's static input buffers)
        self._prefill_graphs: OrderedDict[tuple, tuple[GraphRunner, dict]] = OrderedDict()
        # One memory pool for all prefill buckets (they never run at once and their outputs are copied out),
        # so the buckets kept cost about one prefill's activations, not one each.
        self._prefill_pool = None
        # A server's decoders defer captures (`defer`): a bucket with no graph yet is prefilled eagerly (padded as
        # its graph would be, so the result is the same) and captured by capture_deferred() while the GPU is idle;
        # a capture costs four prefills, which a request waiting on it would pay.
        self.defer = False
        self._wanted: OrderedDict[tuple, dict] = OrderedDict()  # bucket key -> its inputs' (shape, dtype)
        self._need = 0  # the positions the last prefill needed
        self._last_rows = 0  # the last prompt's length, and by how much it grew over the one before
        self._growth = 0
        self._stepped_by: str | None = None  # "tokens" (step) or "embeds" (step_embeds): how a dummy step goes
        self._prefill_captures = 0
        # how the last prefill ran: graph, deferred (eager), eager, long; a continued one reused (eager),
        # reused_graph or reused_deferred (eager, padded as its graph will be)
        self.last_prefill: str | None = None
        self._held: _Held | None = None  # the last prompt, where a next turn may read its rows from the cache
        # a conversation's last prefill: its continued-prefill graph key and input specs, for turn_ended() to
        # want the next turn's bucket once the answer's length is known
        self._turn: tuple[tuple, dict] | None = None

    @property
    def captures(self) -> int:
        return self.runner.captures

    @property
    def prefill_captures(self) -> int:
        """Prefill graphs captured over the decoder's life (released ones included)."""
        return self._prefill_captures

    def check_supported(self) -> None:
        """A ModelError where a layer is one decoder_layer does not compute (Decoders checks each decoder once)."""
        for i, layer in enumerate(self.model.layers):
            if not supported(layer):
                raise ModelError(f"decoder layer {i} of {type(self.model).__name__} has an MLP orin-omni cannot run "
                                 "(Qwen3-Omni's are SiLU): this checkpoint is not a Qwen3-Omni one")

    def _alloc(self, max_len: int) -> None:
        # the old caches, and the graphs that read them, go first: a grown cache (a long video after a short
        # prompt) never sits beside its predecessor
        self.release()
        cfg = self.cfg
        dtype = self.head.weight.dtype
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.positions = torch.arange(max_len, device=self.device)
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.embeds = torch.zeros((1, 1, cfg.hidden_size), dtype=dtype, device=self.device)
        self.idx = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.delta = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.max_len = max_len

    def _release_prefill_graphs(self) -> None:
        again = OrderedDict()
        for key, (runner, static) in self._prefill_graphs.items():
            runner.release()
            if self.defer and key not in self._wanted:  # captured again while idle, after what is wanted now
                again[key] = _specs(static)
        self._prefill_graphs.clear()
        if again:
            again.update(self._wanted)
            self._wanted = again
        self._trim_wanted()
        self._prefill_pool = None

    def release(self) -> None:
        """Drop the cache buffers and the graphs (their memory goes back to the allocator)."""
        self.k_cache, self.v_cache, self.max_len = [], [], 0
        self._held = None
        self.runner.release()
        self._release_prefill_graphs()

    def _weights(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + [b for b in self.model.buffers() if b is not None] + \
            list(self.head.parameters())

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    # ------------------------------------------------------------------ prefill

    def prefill(self, embeds: torch.Tensor, position_ids: torch.Tensor, max_len: int, record: tuple[int, ...] = (),
                visual: tuple | None = None, rope_delta: int = 0, bucket: int | None = None,
                graph: bool = True, continues: bool = False) -> Prefilled:
        """The prompt through decoder_layer from position 0, its keys and values written into the static caches
        (no DynamicCache, no copy). embeds [T, H] (multimodal features already merged); position_ids [3, 1, T]
        and rope_delta (M-RoPE, orin.positions: generated position n is at T + n + rope_delta); record: the
        HF hidden-state indices to return (0 = the embeddings, i = layer i-1's output before any deepstack);
        visual: (the image tokens' rows [n] on the device, deepstack features [n, H] for the first layers).

        With graphs enabled (CUDA, and `graph`: the caller's word that the weights stay where they are, so a
        capture is replayed more than once) the prompt is padded to its bucket (prefill_bucket, or a multiple of
        `bucket`) and the whole prefill replayed from a CUDA graph captured once per bucket: the eager prefill is
        ~5,000 kernel launches, and the host, not the GPU, sets its time. Padding rows come after the prompt, so
        causal attention keeps them out of its rows; their cache entries lie past the prompt, where decoding
        masks them until it overwrites them.

        Where the weights stay put, a prompt of up to HELD_MAX_BYTES is held for the turn after: with
        `continues` (a conversation's next turn) the rows a prompt shares with the held one, whose keys and
        values are still in the cache, are not computed again; the rest is prefilled after them (eagerly,
        causal over the whole cache)."""
        T = int(embeds.shape[0])
        # Whole granules where the weights stay put (the graphs that read the cache live on); time-sliced, the
        # cache is sized to the request, as every byte counts against the budget (the plan counts granules).
        kept = graph
        record = tuple(sorted(set(record)))
        if continues and kept:
            shared = self._shared_rows(embeds, position_ids, visual, record, max(max_len, T + 1))
            if shared:
                return self._prefill_after(shared, embeds, position_ids, visual, record, rope_delta,
                                           max(max_len, T + 1))
        self._held = None  # this prefill overwrites the rows; held again below once they are this prompt's
        self._turn = None
        # the deepstack levels as given: a long prompt's prefill drops each from its list once added
        visual_given = None if visual is None else (visual[0], list(visual[1]))
        # a long prompt's kernels are large enough that launches cost nothing (orin.components.LONG_PREFILL_TOKENS)
        graph = graph and T <= C.LONG_PREFILL_TOKENS and self._graphs_for(embeds)
        Tb = -(-T // bucket) * bucket if bucket else prefill_bucket(T) if graph else T
        self._growth, self._last_rows = (T - self._last_rows if 0 < self._last_rows < T else 0), T
        self._need = max(max_len, Tb, T + 1)
        if self._need > self.max_len or not self.k_cache:
            self._alloc(C.cache_positions(self._need) if kept else -(-self._need // 64) * 64)
        m = self.model
        cos, sin = m.rotary_emb(embeds.unsqueeze(0), position_ids)
        inputs = {"x": embeds, "cos": cos[0], "sin": sin[0]}
        eager_visual = None
        if visual is not None and visual[1] and graph:  # a captured graph takes them as one static [L, T, H]
            rows = visual[0]
            ds = embeds.new_zeros((len(visual[1]), T, embeds.shape[1]))
            for i, feat in enumerate(visual[1]):
                ds[i].index_copy_(0, rows, feat.to(ds.dtype))
            inputs["ds"] = ds
        elif visual is not None and visual[1]:  # eagerly, added at their rows: no [L, T, H] for a long video
            eager_visual = visual
        if Tb > T:
            inputs = {k: F.pad(v, (0, 0, 0, Tb - T)) for k, v in inputs.items()}
        if Tb > T or graph:  # padding rows route to no expert: the MoE, most of a prefill's work, skips them
            inputs["valid"] = (torch.arange(Tb, device=self.device) < T).unsqueeze(1)
        inputs["last"] = torch.tensor([T - 1], device=self.device)
        key = (Tb, record, tuple(inputs["ds"].shape) if "ds" in inputs else None)
        consumed = False  # whether the prefill overwrote the embeddings (a long prompt's)
        holdable = True  # whether a next turn may read this prompt's rows from the cache
        if graph and self.defer and key not in self._prefill_graphs:
            self._want(T, key, inputs)
            logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record)
            self.last_prefill = "deferred"
        elif graph:
            logits, hidden, states = self._prefill_graph(key, inputs)
            self.last_prefill = "graph"
        elif T > C.LONG_PREFILL_TOKENS:
            # the prompt's embeddings are overwritten in place (no whole-prompt copy) where nothing reads them
            # after: not recorded, and not held for a next turn
            held = kept and _held_bytes(embeds, visual_given, len(record)) <= HELD_MAX_BYTES
            consumed = 0 not in record and not held
            if not held:  # each deepstack level goes once added (0.27 GiB at 2 fps), not after the last layer
                visual_given, holdable = None, False
            logits, hidden, states = self._prefill_chunked(inputs, record, eager_visual,
                                                           C.LONG_PREFILL_TOKENS * self.widen, consumed)
            self.last_prefill = "long"
        else:
            logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record, eager_visual)
            self.last_prefill = "eager"
        if continues and graph and self.defer:
            self._want_after(T, Tb, inputs, record)
        self.delta.fill_(rope_delta)
        self.length = T
        self.runner.check = True
        states = {i: s[:T] for i, s in states.items()}
        self._held = _hold(embeds, position_ids, visual_given, states) if kept and holdable and not consumed else None
        return Prefilled(logits, hidden, {i: s.unsqueeze(0) for i, s in states.items()})

    def _shared_rows(self, embeds, position_ids, visual, record: tuple[int, ...], need: int) -> int:
        """How many leading rows of this prompt the cache holds already (0: too few to be worth it, or none):
        the last prompt's rows with the same embeddings, positions and deepstack features, at most all but
        this prompt's last row (its logits are wanted), where the cache needs no reallocation."""
        held = self._held
        T = int(embeds.shape[0])
        if held is None or need > self.max_len or not set(record) <= set(held.states):
            return 0
        n = min(int(held.embeds.shape[0]), T - 1)
        if n < REUSE_MIN_ROWS:
            return 0
        same = (embeds[:n] == held.embeds[:n]).all(dim=1)
        same &= (position_ids[:, 0, :n] == held.position_ids[:, 0, :n]).all(dim=0)
        shared = n if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))
        shared = min(shared, _same_visual_before(visual, held.visual, shared))
        # the rows after are prefilled in one pass: a long rest goes the whole prompt's layer-major way
        return shared if shared >= REUSE_MIN_ROWS and T - shared <= C.LONG_PREFILL_TOKENS else 0

    def _prefill_after(self, shared: int, embeds, position_ids, visual, record: tuple[int, ...],
                       rope_delta: int, need: int) -> Prefilled:
        """The prompt's rows after the `shared` ones the cache holds: written after them, attending causally over
        the whole cache; the recorded hidden states are the held ones' first rows and this prefill's.

        With graphs enabled the rows are padded to their bucket and replayed from a graph of their own (key
        AFTER), which takes the positions and the mask over the whole cache as inputs, so one capture serves
        any prefix length: a Realtime turn's new rows are a few hundred, and eagerly their ~5,000 launches took
        160-210 ms (run 21) where the graph of the whole conversation had taken 84-124 ms (run 20b)."""
        m, held = self.model, self._held
        self._held = None  # rows past `shared` are overwritten from here on; held again once all are this prompt's
        T = int(embeds.shape[0])
        R = T - shared
        self._growth, self._last_rows = (T - self._last_rows if 0 < self._last_rows < T else 0), T
        x = embeds[shared:]
        Rb = prefill_bucket(R)
        graph = self._graphs_for(x) and shared + Rb <= self.max_len and self._after_mask_fits(Rb)
        self._need = max(need, shared + Rb) if graph else need
        cos, sin = m.rotary_emb(x.unsqueeze(0), position_ids[..., shared:])
        rest = None  # the deepstack rows after the shared ones, counted from the first row prefilled
        if visual is not None and visual[1]:
            after = visual[0] >= shared
            rest = (visual[0][after] - shared, [feat[after] for feat in visual[1]])
        self._turn = None
        if graph:
            inputs = self._after_inputs(x, cos[0], sin[0], rest, shared, Rb)
            key = (Rb, record, tuple(inputs["ds"].shape) if "ds" in inputs else None, AFTER)
            if self.defer and key[2] is None:
                self._turn = (key, {k: _meta(v) for k, v in inputs.items()})
            if self.defer and key not in self._prefill_graphs:
                self._want(R, key, inputs)
                logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record)
                self.last_prefill = "reused_deferred"
            else:
                logits, hidden, states = self._prefill_graph(key, inputs)
                self.last_prefill = "reused_graph"
        else:
            inputs = {"x": x, "cos": cos[0], "sin": sin[0], "last": torch.tensor([R - 1], device=self.device)}
            logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record, rest, start=shared)
            self.last_prefill = "reused"
        states = {i: torch.cat([held.states[i][:shared], s[:R]]) for i, s in states.items()}
        self.delta.fill_(rope_delta)
        self.length = T
        self.runner.check = True
        self._held = _hold(embeds, position_ids, visual, states)
        return Prefilled(logits, hidden, {i: s.unsqueeze(0) for i, s in states.items()})

    def _want_after(self, T: int, Tb: int, inputs: dict, record: tuple[int, ...]) -> None:
        """A conversation's first turn: want the continued-prefill buckets of a next turn about as long as this
        prompt (its answer and the next question), so that the second turn already replays a graph."""
        rep = self._rep
        meta = {k: _meta(v) for k, v in inputs.items() if k != "ds"}
        meta["valid"] = torch.empty((Tb, 1), dtype=torch.bool, device="meta")
        meta["pos"] = torch.empty((Tb,), dtype=torch.long, device="meta")
        meta["mask"] = torch.empty((1, 1, rep * Tb, self.max_len), dtype=torch.bool, device="meta")
        key = (Tb, record, None, AFTER)
        self._want(T, key, meta)
        self._turn = (key, meta)

    def turn_ended(self, next_rows: int) -> None:
        """A conversation's answer is done: want the continued-prefill buckets of a next turn of about
        `next_rows` new rows (Engine: the answer and a question as long as this one), captured while the user
        listens and speaks. At the prefill only this prompt's length was known, and a first turn wanted buckets
        about as long as itself, system prompt included: the second turn's new rows ran eagerly, 0.1-0.2 s
        slower than their graph (runs 32-33)."""
        if self._turn is None or not self.defer:
            return
        key, meta = self._turn
        self._turn = None
        self._want(next_rows, key, meta)

    def _after_inputs(self, x, cos, sin, rest, shared: int, Rb: int) -> dict:
        """A continued prefill's graph inputs: its R rows padded to Rb, their cache positions from `shared` on,
        and the mask over the whole cache (row r*Rb+t, query head r of a KV group at row t, sees the keys up to
        its own position; padding rows write and read past the prompt, where decoding masks them)."""
        R = x.shape[0]
        pad = Rb - R
        inputs = {k: F.pad(v, (0, 0, 0, pad)) for k, v in (("x", x), ("cos", cos), ("sin", sin))}
        if rest is not None:
            ds = x.new_zeros((len(rest[1]), Rb, x.shape[1]))
            for i, feat in enumerate(rest[1]):
                ds[i].index_copy_(0, rest[0], feat.to(ds.dtype))
            inputs["ds"] = ds
        rows = torch.arange(Rb, device=self.device)
        inputs["valid"] = (rows < R).unsqueeze(1)
        inputs["last"] = torch.tensor([R - 1], device=self.device)
        inputs["pos"] = rows + shared
        inputs["mask"] = (self.positions.view(1, -1) <= inputs["pos"].view(-1, 1)).repeat(self._rep, 1).view(
            1, 1, self._rep * Rb, self.max_len)
        return inputs

    @property
    def _rep(self) -> int:
        """Query heads per KV head: a masked pass's rows per prompt row."""
        return self.cfg.num_attention_heads // self.cfg.num_key_value_heads

    def _after_mask_fits(self, rows: int) -> bool:
        return self._rep * rows * self.max_len <= AFTER_MASK_MAX

    def _graphs_for(self, rows: torch.Tensor) -> bool:
        """Whether this prefill may go through a CUDA graph: graphs enabled (CUDA, INT4 experts throughout) and
        the MoE free of host syncs."""
        return self.runner.graph_enabled and self._prefill_capturable(rows)

    def _prefill_capturable(self, rows: torch.Tensor) -> bool:
        """Whether every MoE layer's prefill runs without a host sync (orin.int4's fused Triton path): else
        the prefill stays eager (CPU; no Triton; packed shapes the kernel does not take, as the tiny model's).
        Only asked with graphs enabled, i.e. INT4 experts throughout (_int4_experts_only)."""
        return all(layer.mlp.experts.fused(rows, layer.mlp.gate.top_k)
                   for layer in self.model.layers if hasattr(layer.mlp, "experts"))

    def _prefill_chunked(self, inputs: dict, record: tuple[int, ...], visual: tuple | None, chunk: int,
                         consume: bool = False):
        """A long prompt (a video's tens of thousands of tokens) one layer at a time over the whole prompt: the
        attention `chunk` queries at a time, each chunk over the keys the chunks before it wrote (the working
        memory is a chunk's), or on Hopper whole on cuDNN, one KV group at a time (attention_block_long: twice
        flash-attention 2's rate there); the MLP over every row at once, so each layer's INT4 experts are dequantized once
        (decoder_layer.mlp_block_long), where a chunk-major order dequantized them once per chunk. Besides a
        chunk's or an expert piece's working memory, two whole-prompt hidden states live at once (the layer's
        input, overwritten by its output, and the MLP's normed input) plus the recorded ones the talker reads.
        `visual`'s deepstack levels (a list) are consumed: each is dropped once added. With `consume` the input
        embeddings are the first layer's to overwrite (at 25k tokens, 100 MB less than a copy)."""
        m = self.model
        x, cos, sin = inputs["x"], inputs["cos"], inputs["sin"]
        T = x.shape[0]
        layers = self._prefill_layers(inputs)
        states = {0: x} if 0 in record else {}
        owned = consume  # whether x is this loop's to overwrite: not the caller's embeddings, not a recorded state
        whole = cudnn_whole_prompt(x.device)  # Hopper: the attention over every row in one cuDNN call per group
        for i, (spec, w) in enumerate(layers):
            if not owned:
                x, owned = x.clone(), True
            # While deepstack levels wait to be added (a video's first layers; 0.27 GiB at 2 fps) the prefill's peak
            # is here: these layers take the leaner variants, the attention in chunks (no whole-prompt output
            # buffer) and MoE blocks of half the rows.
            lean = visual is not None and i < len(visual[1])
            if whole and not lean:
                x = attention_block_long(x, cos, sin, self.k_cache[i], self.v_cache[i], w, spec, chunk)
            else:
                # in place, chunk by chunk: a later chunk reads only its own rows of x, the earlier ones' keys and
                # values being in the cache already
                for s in range(0, T, chunk):
                    e = min(T, s + chunk)
                    x[s:e] = attention_block(x[s:e], cos[s:e], sin[s:e], None, self.positions[s:e],
                                             self.k_cache[i], self.v_cache[i], w, spec, prefix=s)
            x = mlp_block_long(x, w, spec, chunk, C.LONG_MOE_BLOCK_ROWS * self.widen // (2 if lean else 1))
            if i + 1 in record:
                states[i + 1] = m.norm(x) if i + 1 == len(layers) else x
                owned = i + 1 == len(layers)
            if visual is not None and i < len(visual[1]):
                feat = visual[1][i].to(x.dtype)
                x, owned = (x.index_add_(0, visual[0], feat) if owned else x.index_add(0, visual[0], feat)), True
                visual[1][i] = feat = None  # consumed: a long video's deepstack level is a hundred MB
        hidden = m.norm(x[-1:])
        return self.head(hidden), hidden.unsqueeze(0), states

    def _prefill_layers(self, inputs: dict) -> list[tuple]:
        """Each layer's spec and weights for a prefill: its experts module computes the MoE, skipping padding
        rows where the prompt was padded to a bucket."""
        layers = []
        for layer in self.model.layers:
            spec, w = layer_weights(layer, self.device)
            if spec.mlp != "dense":
                w["experts_module"] = layer.mlp.experts
                if "valid" in inputs:
                    w["valid_rows"] = inputs["valid"]
            layers.append((spec, w))
        return layers

    def _prefill_forward(self, layer_fn, inputs: dict, record: tuple[int, ...], visual: tuple | None = None,
                         start: int = 0):
        """The rows of `inputs` through every layer, written into the caches from position `start` (0: a whole
        prompt; more: the rows after a prefix the caches hold, attending over it too), or at the positions
        `inputs["pos"]` under `inputs["mask"]` where given (_after_inputs)."""
        m = self.model
        x = inputs["x"]
        if "mask" in inputs:  # a continued prefill's graph: its positions and mask are inputs
            pos, mask, after = inputs["pos"], inputs["mask"], {}
        else:
            pos, mask = self.positions[start:start + x.shape[0]], None
            after = {"prefix": start} if start else {}
        ds = inputs.get("ds")
        states = {0: x} if 0 in record else {}
        for i, (spec, w) in enumerate(self._prefill_layers(inputs)):
            x = layer_fn(x, inputs["cos"], inputs["sin"], mask, pos, self.k_cache[i], self.v_cache[i], w, spec,
                         **after)
            if i + 1 in record:
                states[i + 1] = m.norm(x) if i + 1 == len(m.layers) else x  # HF's last entry is normed
            if ds is not None and i < ds.shape[0]:
                x = x + ds[i]
            elif visual is not None and i < len(visual[1]):
                x = x.index_add(0, visual[0], visual[1][i].to(x.dtype))
        hidden = m.norm(x.index_select(0, inputs["last"]))
        return self.head(hidden), hidden.unsqueeze(0), states

    def _prefill_graph(self, key: tuple, inputs: dict):
        """Replay (capturing first where needed) the prefill graph of bucket key (rows, recorded states,
        deepstack shape); outputs are copied out, so the next prefill may overwrite them."""
        record = key[1]
        entry = self._prefill_graphs.pop(key, None)
        if entry is None:
            while len(self._prefill_graphs) >= PREFILL_GRAPHS:  # least recently used first
                self._prefill_graphs.pop(next(iter(self._prefill_graphs)))[0].release()
            # the layer function is captured uncompiled: a prefill is a few large kernels per layer, not
            # worth a compilation per bucket
            if self._prefill_pool is None and self.device.type == "cuda":
                self._prefill_pool = torch.cuda.graph_pool_handle()
            entry = (GraphRunner(self.device, True, False, pool=self._prefill_pool, warmups=PREFILL_CAPTURE_WARMUPS),
                     {k: torch.empty_like(v) for k, v in inputs.items()})
        self._prefill_graphs[key] = entry
        runner, static = entry
        for k, v in inputs.items():
            static[k].copy_(v)
        runner.check = True
        before = runner.captures
        try:
            logits, hidden, states = runner.run(lambda fn: self._prefill_forward(fn, static, record),
                                                lambda: self._weights() + self.k_cache + self.v_cache)
        except Exception:
            self._prefill_graphs.pop(key)[0].release()  # no graph-less entry is left to be replayed
            raise
        self._prefill_captures += runner.captures - before
        return logits.clone(), hidden.clone(), {i: s.clone() for i, s in states.items()}

    def _want(self, T: int, key: tuple, inputs: dict) -> None:
        """Note the bucket just prefilled eagerly, and those of the longer prompts likely next (_lookahead), for
        capture_deferred(). A continued prefill's (key AFTER; T its new rows) wants its own bucket and the next
        ones up: a conversation's turns add an answer and a question each, about as many rows every time."""
        Tb, record = key[:2]
        shapes = _specs(inputs)
        if key[3:] == (AFTER,):
            lo, hi, nxt, growing = T, T + PREFILL_LOOKAHEAD // 2, Tb, False
        else:  # growing prompts: around the next one's predicted length (this one plus the last growth)
            lo, hi = T + self._growth // 2, T + self._lookahead()
            nxt, growing = prefill_bucket(min(T + self._growth, C.LONG_PREFILL_TOKENS)), bool(self._growth)
        ahead = {prefill_bucket(n) for n in (*range(lo, hi, 64), hi)} - {Tb}
        # capture_deferred() takes the newest first: the predicted next prompt's bucket and its neighbours, this
        # prompt's own (a repeat of it) last where prompts grow, first where they do not; the trim drops the
        # least likely first
        order = sorted(ahead, key=lambda b: -abs(b - nxt))
        for rows in ([Tb, *order] if growing else [*order, Tb]):
            if rows > C.LONG_PREFILL_TOKENS or (key[3:] == (AFTER,) and not self._after_mask_fits(rows)):
                continue
            # a row dimension may hold several rows per prompt row (the mask's, one per query head of a group)
            spec = {k: (shape[:_ROW_DIM[k]] + (shape[_ROW_DIM[k]] // Tb * rows,) + shape[_ROW_DIM[k] + 1:]
                        if k in _ROW_DIM else shape, dtype)
                    for k, (shape, dtype) in shapes.items()}
            ds = spec.get("ds")
            wanted = (rows, record, ds[0] if ds else None) + key[3:]
            if wanted not in self._prefill_graphs:
                self._wanted.pop(wanted, None)
                self._wanted[wanted] = spec  # the latest request's buckets are captured first
        self._trim_wanted()

    def _trim_wanted(self) -> None:
        # more than the graphs kept would have the idle captures evict each other
        while len(self._wanted) > PREFILL_GRAPHS // 2:
            self._wanted.popitem(last=False)

    def _lookahead(self) -> int:
        return min(PREFILL_LOOKAHEAD_MAX, max(PREFILL_LOOKAHEAD, self._growth * 3 // 2))

    @property
    def deferred(self) -> int:
        """Captures capture_deferred() would make now."""
        return len(self._wanted) + (self._grow_to() is not None)

    def _grow_to(self) -> int | None:
        """The cache size the next prompts need, when the cache is smaller (a conversation nearing its end)."""
        if not self.defer or not self.k_cache or self._stepped_by is None:
            return None
        size = C.cache_positions(self._need + self._lookahead())
        return size if size > self.max_len else None

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        """While the GPU is idle (a server between requests): grow the cache ahead of a growing conversation
        (re-capturing the decode step), then capture the wanted prefill buckets, newest first, one at a time
        until `stop()`. Each writes garbage into the cache, which the next prefill overwrites; the held
        prompt's rows (a conversation's next turn reads them) are put back afterwards. Returns the captures
        made."""
        if not self.k_cache or (self._grow_to() is None and not self._wanted):
            return 0
        held = self._held
        n = 0 if held is None else int(held.embeds.shape[0])
        kept = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(self.k_cache, self.v_cache, strict=True)
                if n]
        made = 0
        self._held = None  # not held while the rows are garbage: a failed capture leaves them so
        size = self._grow_to()
        if size is not None and not stop():
            self._alloc(size)
            self.length = 0
            self.delta.fill_(0)
            if self._stepped_by == "tokens":
                self.step(0)
            else:
                self.step_embeds(torch.zeros_like(self.embeds))
            self.length = 0
            made += 1
        while self._wanted and not stop():
            key, spec = self._wanted.popitem()
            if key in self._prefill_graphs or key[0] > self.max_len:
                continue
            # a mask spans the cache as it is now (grown above, maybe, since it was wanted)
            inputs = {k: torch.zeros(shape[:-1] + (self.max_len,) if k == "mask" else shape, dtype=dtype,
                                     device=self.device) for k, (shape, dtype) in spec.items()}
            inputs["last"].fill_(key[0] - 1)
            if "mask" in inputs:  # every row sees a key, as in use: a row that sees none is NaN
                inputs["mask"].fill_(True)
            self._prefill_graph(key, inputs)
            made += 1
        for i, (k_rows, v_rows) in enumerate(kept):
            self.k_cache[i][:, :, :n] = k_rows
            self.v_cache[i][:, :, :n] = v_rows
        self._held = held  # the rows are the held prompt's again
        return made

    def _forward(self, layer_fn, from_tokens: bool):
        m = self.model
        x = m.embed_tokens(self.tok)[0] if from_tokens else self.embeds[0]
        pos = (self.idx + self.delta).view(1, 1, 1).expand(3, 1, 1)
        cos, sin = m.rotary_emb(x.unsqueeze(0), pos)
        cos, sin = cos[0], sin[0]
        mask = (self.positions <= self.idx).view(1, 1, 1, -1)
        for i, layer in enumerate(m.layers):
            spec, w = layer_weights(layer, self.device)
            x = layer_fn(x, cos, sin, mask, self.idx, self.k_cache[i], self.v_cache[i], w, spec)
        hidden = m.norm(x)
        return self.head(hidden), hidden.unsqueeze(0)

    def _advance(self):
        if self.length >= self.max_len:
            raise RuntimeError(f"static KV cache full ({self.max_len} positions); prefill() with a larger max_len")
        self.idx.fill_(self.length)

    def step(self, token: int) -> torch.Tensor:
        self._stepped_by = "tokens"
        self._advance()
        self.tok.fill_(token)
        logits, _ = self.runner.run(lambda fn: self._forward(fn, True), self._weights)
        self.length += 1
        return logits

    def step_embeds(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._stepped_by = "embeds"
        self._advance()
        self.embeds.copy_(embeds.reshape(self.embeds.shape))
        logits, hidden = self.runner.run(lambda fn: self._forward(fn, False), self._weights)
        self.length += 1
        return logits, hidden


def _hold(embeds: torch.Tensor, position_ids: torch.Tensor, visual, states: dict) -> _Held | None:
    """The prompt to hold for a next turn, or None where it would keep more than HELD_MAX_BYTES alive (its
    embeddings, recorded hidden states and deepstack features)."""
    if _held_bytes(embeds, visual, len(states)) > HELD_MAX_BYTES:
        return None
    return _Held(embeds, position_ids, None if visual is None else (visual[0], list(visual[1])), states)


def _held_bytes(embeds: torch.Tensor, visual, states: int) -> int:
    """What holding a prompt keeps alive: its embeddings, `states` recorded hidden states like them, and its
    deepstack features."""
    levels = visual[1] if visual is not None and visual[1] else []
    return embeds.numel() * embeds.element_size() * (1 + states) + sum(t.numel() * t.element_size() for t in levels)


def _same_visual_before(visual, held_visual, rows: int) -> int:
    """`rows`, or fewer: the first deepstack row before `rows` where this prompt's and the held prompt's visual
    rows or features differ (a deepstack level is added to an image's rows after the first layers)."""
    mine, theirs = _visual_before(visual, rows), _visual_before(held_visual, rows)
    if mine[0].numel() == theirs[0].numel() == 0:
        return rows
    if mine[0].shape == theirs[0].shape and torch.equal(mine[0], theirs[0]) and len(mine[1]) == len(theirs[1]) \
            and all(torch.equal(a, b) for a, b in zip(mine[1], theirs[1], strict=True)):
        return rows
    return min(int(r.min()) for r, _ in (mine, theirs) if r.numel())


def _visual_before(visual, rows: int) -> tuple[torch.Tensor, list]:
    """(the deepstack rows before `rows`, each level's features at them) of a prefill's `visual`."""
    if visual is None or not visual[1]:
        return torch.empty(0, dtype=torch.long), []
    keep = visual[0] < rows
    return visual[0][keep], [feat[keep] for feat in visual[1]]


# ---------------------------------------------------------------------- code predictor


class CodePredictor:
    """The talker's code predictor: a 2-position prefill (the talker's last hidden state and the frame's first
    code) then one position per residual code group, each with its own lm_head and codec embedding. Returns
    (codes [groups-1], sum of the frame's codec embeddings). Greedy, it is one CUDA graph per frame; sampled, the
    same steps run eagerly with the caller's sampler choosing each code."""

    def __init__(self, model, device: torch.device, compile: bool = False):
        cp = model.talker.code_predictor
        self.cp = cp
        self.cfg = cp.config
        self.device = device
        self.runner = GraphRunner(device, device.type == "cuda", compile)
        self.groups = len(cp.lm_head)  # residual code groups (num_code_groups - 1)
        self.built = False

    def _build(self) -> None:
        cfg, dev = self.cfg, self.device
        dtype = self.cp.lm_head[0].weight.dtype
        max_len = -(-(self.groups + 1) // 8) * 8
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.inputs = torch.zeros((2, cfg.hidden_size), dtype=dtype, device=dev)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = torch.arange(max_len, device=dev)
        # Prefill rows r*2+t (t = 0, 1) see keys <= t; step s (position s+1) sees keys <= s+1.
        self.prefill_mask = (keys.view(1, -1) <= torch.arange(2, device=dev).repeat(rep).view(-1, 1)).view(
            1, 1, 2 * rep, max_len)
        self.step_masks = [(keys <= s + 1).view(1, 1, 1, max_len) for s in range(1, self.groups)]
        self.positions = [torch.arange(2, device=dev)] + [torch.tensor([s + 1], device=dev)
                                                          for s in range(1, self.groups)]
        self.built = True

    def _weights(self) -> list[torch.Tensor]:
        return list(self.cp.parameters()) + [b for b in self.cp.buffers() if b is not None]

    def _forward(self, layer_fn, choose: Callable[[torch.Tensor], torch.Tensor] | None = None):
        m = self.cp.model
        x = self.inputs
        codes, embeds = [], self.inputs[1:2]
        for s in range(self.groups):
            pos = self.positions[s]
            mask = self.prefill_mask if s == 0 else self.step_masks[s - 1]
            cos, sin = m.rotary_emb(x.unsqueeze(0), pos.view(1, -1))
            cos, sin = cos[0], sin[0]
            for i, layer in enumerate(m.layers):
                spec, w = layer_weights(layer, self.device)
                x = layer_fn(x, cos, sin, mask, pos, self.k_cache[i], self.v_cache[i], w, spec)
            logits = self.cp.lm_head[s](m.norm(x[-1:]))
            code = torch.argmax(logits, dim=-1) if choose is None else choose(logits)
            codes.append(code)
            emb = m.codec_embedding[s](code)
            embeds = embeds + emb
            x = emb
        return torch.cat(codes), embeds.unsqueeze(0)

    def run(self, past_hidden: torch.Tensor, last_id_hidden: torch.Tensor,
            choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`choose(logits [1, vocab]) -> code [1]` samples a code; None is greedy."""
        if not self.built:
            self._build()
        self.inputs[0].copy_(past_hidden.reshape(-1))
        self.inputs[1].copy_(last_id_hidden.reshape(-1))
        if choose is not None:
            return self._forward(decoder_layer, choose)
        return self.runner.run(self._forward, self._weights)

    def release(self) -> None:
        self.built = False
        self.runner.release()


class Decoders:
    """The model's three decoders (thinker, talker, code predictor), built once and kept with their static caches
    and graphs for the engine's life."""

    def __init__(self, model, device: torch.device, compile: bool):
        self.model, self.device, self.compile = model, device, compile
        self._made: dict[str, object] = {}

    def _get(self, kind: str, make: Callable[[], object]):
        if kind not in self._made:
            dec = make()
            if isinstance(dec, StaticDecoder):
                dec.check_supported()
            self._made[kind] = dec
        return self._made[kind]

    @property
    def thinker(self) -> StaticDecoder:
        t = self.model.thinker
        return self._get("thinker", lambda: StaticDecoder(t.model.language_model, t.lm_head, self.device,
                                                          self.compile))

    @property
    def talker(self) -> StaticDecoder:
        t = self.model.talker
        thinker_hidden = self.model.thinker.model.language_model.config.hidden_size
        return self._get("talker", lambda: StaticDecoder(
            t.model, t.codec_head, self.device, self.compile,
            C.long_prefill_widen(thinker_hidden, t.model.config.hidden_size)))

    @property
    def code_predictor(self) -> CodePredictor:
        return self._get("code_predictor", lambda: CodePredictor(self.model, self.device, self.compile))

    def defer_captures(self, defer: bool) -> None:
        """A server's setting: prefill buckets are captured while the GPU is idle (capture_deferred), not by
        the request that first needs one."""
        self.thinker.defer = self.talker.defer = defer

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        return sum(dec.capture_deferred(stop) for dec in self._made.values() if isinstance(dec, StaticDecoder))

    def weights_may_have_moved(self) -> None:
        """After a swap: every decoder compares its weights' addresses with its graphs' before the next replay
        (re-capturing where they moved). The step graphs only checked at a prefill, which the code predictor
        never has: swapped out and in between two requests, it replayed onto freed memory."""
        for dec in self._made.values():
            dec.runner.check = True

    def captured(self) -> bool:
        """Whether any decoder has captured a CUDA graph (decode steps or a prefill bucket)."""
        return any(d.runner.captures or getattr(d, "prefill_captures", 0) for d in self._made.values())

    def stats(self) -> dict:
        """Per decoder: CUDA-graph captures (and their seconds) and the torch.compile error, if compiling failed."""
        return {kind: {"captures": d.runner.captures, "capture_s": round(d.runner.capture_s, 4),
                       "prefill_captures": getattr(d, "prefill_captures", 0),
                       "compiled": d.runner.compile, "compile_error": d.runner.compile_error}
                for kind, d in self._made.items()}


__all__ = ["CodePredictor", "Decoders", "Prefilled", "StaticDecoder"]
