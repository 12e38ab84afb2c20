"""Prefill and decoding with static KV caches, one position per decode call, captured in CUDA graphs: the
thinker, the talker and the talker's code predictor. Every layer is orin.runtime.layer's pure function on every
device (the HF modules are only the tests' oracle): a token through the HF modules is thousands of launches and
a host sync per MoE layer, and at batch 1 the GPU waits on Python. The prompt goes through the same function,
its keys and values written straight into the static caches; where the weights stay put the whole prefill is
replayed from a CUDA graph per bucket of rows (eager, its ~5,000 launches, not the GPU, set the time to first
token). Each decode step is captured once per weight placement (orin.runtime.graph_runner), through
torch.compile first with `compile=True`. Which route a prefill takes and which graphs are wanted, captured while idle and dropped is
orin.runtime.capture_policy's to decide; this module keeps the tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..components import long_prefill_widen
from ..device.profile import DeviceProfile
from ..errors import ModelError
from .attention import attention_block, attention_block_long
from .capture_policy import CapturePolicy
from .graph_runner import CodePredictor, GraphRunner, GraphSet
from .layer import decoder_layer, int4_experts_only, layer_weights, mlp_block_long, moe_backend_name, supported
from .prefill_route import GraphKey, Prefilled, PrefillInputs, PrefillRoute, PromptShape, Route


@dataclass
class _Held:
    """The prompt whose keys and values the caches' first rows hold, for a next turn to read instead of computing
    (its embeddings [n, H], positions [3, 1, n], deepstack rows and levels), and its recorded states {i: [n, H]}."""

    embeds: torch.Tensor
    position_ids: torch.Tensor
    visual: tuple | None
    states: dict


class StaticDecoder:
    """One sequence: `prefill(PrefillInputs)`, then `step(token)` (the thinker's: logits [1, vocab]) or
    `step_embeds(embeds)` (the talker's: logits, last hidden). `policy`: its CapturePolicy; `last_prefill`: the
    PrefillRoute the last prefill took."""

    def __init__(self, text_model, head, device: torch.device, profile: DeviceProfile, compile: bool = False,
                 widen: int = 1):
        """`widen`: how many times the thinker's rows a long prompt's chunks and MoE blocks take here
        (orin.components.long_prefill_widen)."""
        self.model, self.head, self.cfg = text_model, head, text_model.config
        self.device, self.profile, self.widen = device, profile, widen
        self.runner = GraphRunner(device, device.type == "cuda" and int4_experts_only(text_model), compile)
        self._rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads  # mask rows per prompt row
        graphs = self.runner.graph_enabled or (device.type != "cuda" and profile.capture.cpu_graph_path)
        self.policy = CapturePolicy(profile, graphs=graphs, heads_per_kv=self._rep)
        self.max_len = self.length = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self._graphs = GraphSet(device, profile.capture.capture_warmups)  # by GraphKey; the policy says which
        self._stepped_by: str | None = None  # "tokens" (step) or "embeds" (step_embeds): how a dummy step goes
        self.last_prefill: PrefillRoute | None = None
        self.last_shared = 0  # the leading rows the last prefill read from the cache (a conversation's turn)
        self._held: _Held | None = None  # the last prompt, where a next turn may read its rows from the cache

    @property
    def captures(self) -> int:
        return self.runner.captures

    @property
    def prefill_captures(self) -> int:
        """Prefill graphs captured over the decoder's life (released ones included)."""
        return self._graphs.captures

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
        cfg, dev, dtype = self.cfg, self.device, self.head.weight.dtype
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.positions = torch.arange(max_len, device=dev)
        self.tok, self.idx, self.delta = (torch.zeros(n, dtype=torch.long, device=dev) for n in ((1, 1), (1,), (1,)))
        self.embeds = torch.zeros((1, 1, cfg.hidden_size), dtype=dtype, device=dev)
        self.max_len = max_len

    def release(self) -> None:
        """Drop the cache buffers and the graphs (their memory goes back to the allocator)."""
        self.k_cache, self.v_cache, self.max_len = [], [], 0
        self._held = None
        self.runner.release()
        self._graphs.release()
        self.policy.released()

    def _weights(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + [b for b in self.model.buffers() if b is not None] + \
            list(self.head.parameters())

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    # ------------------------------------------------------------------ prefill

    def prefill(self, prompt: PrefillInputs, *, graph: bool = True, continues: bool = False) -> Prefilled:
        """The prompt through the layers into the caches, by the route the policy chooses. `graph`: the caller's
        word that the weights stay put, so a graph is replayed more than once; the rows are then padded to their
        bucket (padding rows come after the prompt: causal attention keeps them out of its rows, and decoding masks
        their cache entries until it overwrites them). Such a prompt is held for the turn after: with `continues`
        (a conversation's next turn) the rows it shares with the held one are read from the cache."""
        T, visual, policy = int(prompt.embeds.shape[0]), prompt.visual, self.policy
        record, need = tuple(sorted(set(prompt.record))), max(prompt.max_len, T + 1)
        shape = PromptShape(T, record, len(visual[1]) if visual is not None and visual[1] else 0, prompt.bucket)
        shared = self._shared_rows(prompt, record, need) if continues and graph else 0
        # where graphs are captured, the MoE of these rows must run without a host sync (its backend's grouped path)
        rows = prompt.embeds[shared:]
        capturable = policy.graphs and (not self.runner.graph_enabled or all(
            layer.mlp.experts.fused(rows, layer.mlp.gate.top_k) for layer in self.model.layers
            if hasattr(layer.mlp, "experts")))
        route = policy.route(shape, shared, stays=graph, capturable=capturable, cache=self.max_len, need=need)
        if route.kind.continued:
            out = self._prefill_after(route, prompt, record)
        else:
            out = self._prefill_whole(route, prompt, record, graph)
        self.last_prefill, self.last_shared = route.kind, route.shared
        policy.prefilled(route, need, self.max_len, continues)
        self.delta.fill_(prompt.rope_delta)
        self.length = T
        self.runner.check = True
        return out

    def _prefill_whole(self, route: Route, prompt: PrefillInputs, record: tuple[int, ...], kept: bool) -> Prefilled:
        embeds, T, visual = prompt.embeds, route.rows, prompt.visual
        self._held = None  # this prefill overwrites the rows; held again below once they are this prompt's
        # the deepstack levels as given: a long prompt's prefill drops each from its list once added
        visual_given = None if visual is None else (visual[0], list(visual[1]))
        if route.grows:  # whole granules where the graphs that read the cache live on; else sized to the request
            need = max(prompt.max_len, route.padded, T + 1)
            self._alloc(self.policy.cache_positions(need) if kept else -(-need // 64) * 64)
        cos, sin = self.model.rotary_emb(embeds.unsqueeze(0), prompt.position_ids)
        inputs = self._inputs(embeds, cos[0], sin[0], visual, route.padded, route.key)
        eager_visual = visual if route.key is None and visual is not None and visual[1] else None
        consumed, holdable = False, True  # the embeddings overwritten (a long prompt's); rows a next turn may read
        if route.kind is PrefillRoute.GRAPH:
            logits, hidden, states = self._prefill_graph(route.key, inputs)
        elif route.kind is PrefillRoute.LONG:
            # the embeddings are overwritten in place (no whole-prompt copy) where nothing reads them after: not
            # recorded, not held; nor is a deepstack level once added (a video's are a hundred MB each)
            held = kept and self.policy.may_hold(_held_bytes(embeds, visual_given, len(record)))
            consumed = 0 not in record and not held
            if not held:
                visual_given, holdable = None, False
            logits, hidden, states = self._prefill_chunked(
                inputs, record, eager_visual, self.policy.long_tokens * self.widen, consumed)
        else:  # eager, or deferred: eagerly on the rows its graph will take
            logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record, eager_visual)
        states = {i: s[:T] for i, s in states.items()}
        if kept and holdable and not consumed:
            self._held = self._hold(embeds, prompt.position_ids, visual_given, states)
        return Prefilled(logits, hidden, {i: s.unsqueeze(0) for i, s in states.items()})

    def _shared_rows(self, prompt: PrefillInputs, record: tuple[int, ...], need: int) -> int:
        """The leading rows of the prompt the cache holds already (CapturePolicy.reusable of them): the held
        prompt's rows with the same embeddings, positions and deepstack features, all but the prompt's last row
        at most (its logits are wanted), where the cache needs no reallocation."""
        held, embeds, position_ids = self._held, prompt.embeds, prompt.position_ids
        T = int(embeds.shape[0])
        if held is None or need > self.max_len or not set(record) <= set(held.states):
            return 0
        n = min(int(held.embeds.shape[0]), T - 1)
        if not self.policy.reusable(n, T):
            return 0
        same = (embeds[:n] == held.embeds[:n]).all(dim=1)
        same &= (position_ids[:, 0, :n] == held.position_ids[:, 0, :n]).all(dim=0)
        shared = n if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))
        return self.policy.reusable(min(shared, _same_visual_before(prompt.visual, held.visual, shared)), T)

    def _prefill_after(self, route: Route, prompt: PrefillInputs, record: tuple[int, ...]) -> Prefilled:
        """The rows after the `shared` ones the cache holds, attending causally over the whole cache; the recorded
        states are the held ones' first rows and this prefill's. A graph of these rows (an `after` key) takes
        their positions and the mask as inputs, so one capture serves any prefix length."""
        held, shared, R = self._held, route.shared, route.rows
        self._held = None  # rows past `shared` are overwritten from here on; held again once all are this prompt's
        x, visual = prompt.embeds[shared:], prompt.visual
        cos, sin = self.model.rotary_emb(x.unsqueeze(0), prompt.position_ids[..., shared:])
        rest = None  # the deepstack rows after the shared ones, counted from the first row prefilled
        if visual is not None and visual[1]:
            after = visual[0] >= shared
            rest = (visual[0][after] - shared, [feat[after] for feat in visual[1]])
        inputs = self._inputs(x, cos[0], sin[0], rest, route.padded, route.key, shared)
        if route.kind is PrefillRoute.REUSED_GRAPH:
            logits, hidden, states = self._prefill_graph(route.key, inputs)
        else:  # eager from `shared` on, or deferred: eagerly on the rows its graph will take
            logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record,
                                                           None if route.key else rest, start=shared)
        states = {i: torch.cat([held.states[i][:shared], s[:R]]) for i, s in states.items()}
        self._held = self._hold(prompt.embeds, prompt.position_ids, visual, states)
        return Prefilled(logits, hidden, {i: s.unsqueeze(0) for i, s in states.items()})

    def _hold(self, embeds: torch.Tensor, position_ids: torch.Tensor, visual, states: dict) -> _Held | None:
        """The prompt to hold for a next turn, or None where it would keep more alive than the policy allows."""
        if not self.policy.may_hold(_held_bytes(embeds, visual, len(states))):
            return None
        return _Held(embeds, position_ids, None if visual is None else (visual[0], list(visual[1])), states)

    def turn_ended(self, next_rows: int) -> None:
        """A conversation's answer is done: its next turn will prefill about `next_rows` new rows (the Engine's
        guess: this answer and a question like the last), whose graph is captured while the user listens."""
        self.policy.turn_ended(next_rows, self.max_len)

    def _inputs(self, x, cos, sin, visual, padded: int, key: GraphKey | None, shared: int = 0) -> dict:
        """The prefill inputs of rows x [R, H] (after `shared` rows the cache holds), padded to `padded`: with a
        graph `key`, the deepstack levels as one [L, padded, H], the rows' validity (padding rows route to no
        expert: the MoE, most of the work, skips them) and, for an `after` key, the rows' cache positions and the
        mask over the whole cache (row r*padded+t, head r of a KV group at row t, sees the keys up to its own)."""
        R = x.shape[0]
        inputs = {"x": x, "cos": cos, "sin": sin}
        if padded > R:
            inputs = {k: F.pad(v, (0, 0, 0, padded - R)) for k, v in inputs.items()}
        if key is not None and key.deepstack:
            inputs["ds"] = ds = x.new_zeros((key.deepstack, padded, x.shape[1]))
            for i, feat in enumerate(visual[1] if visual is not None else ()):
                ds[i].index_copy_(0, visual[0], feat.to(ds.dtype))
        if padded > R or key is not None:
            rows = torch.arange(padded, device=self.device)
            inputs["valid"] = (rows < R).unsqueeze(1)
        inputs["last"] = torch.tensor([R - 1], device=self.device)
        if key is not None and key.after:
            inputs["pos"] = rows + shared
            inputs["mask"] = (self.positions.view(1, -1) <= inputs["pos"].view(-1, 1)).repeat(self._rep, 1).view(
                1, 1, self._rep * padded, self.max_len)
        return inputs

    def _capture_inputs(self, key: GraphKey) -> dict:
        """Inputs to capture `key`'s graph with while idle (each replay copies its own in): zero rows, all
        padding, over the cache as it is now."""
        dev, dtype = self.device, self.head.weight.dtype
        z = torch.zeros((key.rows, self.cfg.head_dim), dtype=dtype, device=dev)
        inputs = self._inputs(torch.zeros((key.rows, self.cfg.hidden_size), dtype=dtype, device=dev), z, z, None,
                              key.rows, key)
        inputs["valid"].zero_()
        return inputs

    def _prefill_chunked(self, inputs: dict, record: tuple[int, ...], visual: tuple | None, chunk: int,
                         consume: bool = False):
        """A long prompt (a video's) one layer at a time: the attention `chunk` queries at a time over the keys
        before them, or whole on cuDNN where the profile's capabilities say it runs (attention_block_long); the
        MLP over every row at once, so each layer's INT4 experts are dequantized once (mlp_block_long). Besides a
        chunk's working memory, two whole-prompt hidden states live at once, plus the recorded ones. `visual`'s
        deepstack levels are dropped once added; with `consume` the embeddings are overwritten, not copied."""
        m = self.model
        x, cos, sin = inputs["x"], inputs["cos"], inputs["sin"]
        T = x.shape[0]
        layers = self._prefill_layers(inputs)
        states = {0: x} if 0 in record else {}
        owned = consume  # whether x is this loop's to overwrite: not the caller's embeddings, not a recorded state
        whole = self.profile.capabilities.cudnn_whole_prompt  # every row's attention in one call per KV group
        block_rows = self.profile.prefill.long_moe_block_rows * self.widen
        for i, (spec, w) in enumerate(layers):
            if not owned:
                x, owned = x.clone(), True
            # While deepstack levels wait to be added (a video's first layers) the prefill's peak is here: these
            # layers take the leaner variants, the attention in chunks (no whole-prompt output buffer) and MoE
            # blocks of half the rows.
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
            x = mlp_block_long(x, w, spec, chunk, block_rows // (2 if lean else 1))
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
        """Each layer's spec and weights for a prefill: its experts module computes the MoE, skipping padding rows."""
        layers = []
        for layer in self.model.layers:
            spec, w = layer_weights(layer, self.device, self.profile)
            if spec.mlp != "dense":
                w["experts_module"] = layer.mlp.experts
                if "valid" in inputs:
                    w["valid_rows"] = inputs["valid"]
            layers.append((spec, w))
        return layers

    def _prefill_forward(self, layer_fn, inputs: dict, record: tuple[int, ...], visual: tuple | None = None,
                         start: int = 0):
        """The rows of `inputs` through every layer into the caches from position `start` (more than 0: after a
        prefix the caches hold, attending over it too), or at `inputs["pos"]` under `inputs["mask"]` (_inputs)."""
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

    def _prefill_graph(self, key: GraphKey, inputs: dict):
        """The prefill of `inputs` replayed from `key`'s graph (captured first where there is none, the graphs
        the policy drops released first); outputs are copied out, so the next prefill may overwrite them."""
        drop = () if key in self._graphs else self.policy.admit(key)
        self.policy.used(key)
        try:
            return self._graphs.replay(key, inputs, lambda fn, static: self._prefill_forward(fn, static, key.record),
                                       lambda: self._weights() + self.k_cache + self.v_cache, drop)
        except Exception:
            self.policy.failed(key)
            raise

    # ------------------------------------------------------------------ idle time

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        """While the GPU is idle (a server between requests): grow the cache as the policy says (re-capturing the
        decode step), then capture the graphs it wants, one at a time until `stop()`. Captures write garbage into
        the cache; the held prompt's rows (a next turn reads them) are put back after. Returns the captures made."""
        policy, stepped = self.policy, self._stepped_by is not None
        if not self.k_cache or not policy.pending(self.max_len, stepped):
            return 0
        held = self._held
        n = 0 if held is None else int(held.embeds.shape[0])
        kept = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(self.k_cache, self.v_cache, strict=True)
                if n]
        made = 0
        self._held = None  # not held while the rows are garbage: a failed capture leaves them so
        size = policy.grow_to(self.max_len, stepped)
        if size is not None and not stop():
            by, self.length = self._stepped_by, 0
            self._alloc(size)
            self.delta.fill_(0)
            self.step(0) if by == "tokens" else self.step_embeds(torch.zeros_like(self.embeds))
            self.length, made = 0, made + 1
        while policy.wanted() and not stop():
            key = policy.next_capture(self.max_len)
            if key is None:
                break
            self._prefill_graph(key, self._capture_inputs(key))
            made += 1
        for i, (k_rows, v_rows) in enumerate(kept):
            self.k_cache[i][:, :, :n] = k_rows
            self.v_cache[i][:, :, :n] = v_rows
        self._held = held  # the rows are the held prompt's again
        return made

    # ------------------------------------------------------------------ decode steps

    def _forward(self, layer_fn, from_tokens: bool):
        m = self.model
        x = m.embed_tokens(self.tok)[0] if from_tokens else self.embeds[0]
        pos = (self.idx + self.delta).view(1, 1, 1).expand(3, 1, 1)
        cos, sin = m.rotary_emb(x.unsqueeze(0), pos)
        cos, sin = cos[0], sin[0]
        mask = (self.positions <= self.idx).view(1, 1, 1, -1)
        for i, layer in enumerate(m.layers):
            spec, w = layer_weights(layer, self.device, self.profile)
            x = layer_fn(x, cos, sin, mask, self.idx, self.k_cache[i], self.v_cache[i], w, spec)
        hidden = m.norm(x)
        return self.head(hidden), hidden.unsqueeze(0)

    def _step(self, by: str):
        if self.length >= self.max_len:
            raise RuntimeError(f"static KV cache full ({self.max_len} positions); prefill() with a larger max_len")
        self._stepped_by = by
        self.idx.fill_(self.length)
        out = self.runner.run(lambda fn: self._forward(fn, by == "tokens"), self._weights)
        self.length += 1
        return out

    def step(self, token: int) -> torch.Tensor:
        self.tok.fill_(token)
        return self._step("tokens")[0]

    def step_embeds(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.embeds.copy_(embeds.reshape(self.embeds.shape))
        return self._step("embeds")


def _held_bytes(embeds: torch.Tensor, visual, states: int) -> int:
    """What holding a prompt keeps alive: its embeddings, `states` recorded hidden states like them, and its
    deepstack features."""
    levels = visual[1] if visual is not None and visual[1] else []
    return embeds.numel() * embeds.element_size() * (1 + states) + sum(t.numel() * t.element_size() for t in levels)


def _same_visual_before(visual, held_visual, rows: int) -> int:
    """`rows`, or fewer: the first deepstack row before `rows` where this prompt's and the held prompt's visual
    rows or features differ (a deepstack level is added to an image's rows after the first layers)."""
    mine, theirs = _visual_before(visual, rows), _visual_before(held_visual, rows)
    if mine[0].numel() == theirs[0].numel() == 0 or (
            mine[0].shape == theirs[0].shape and torch.equal(mine[0], theirs[0]) and len(mine[1]) == len(theirs[1])
            and all(torch.equal(a, b) for a, b in zip(mine[1], theirs[1], strict=True))):
        return rows
    return min(int(r.min()) for r, _ in (mine, theirs) if r.numel())


def _visual_before(visual, rows: int) -> tuple[torch.Tensor, list]:
    """(the deepstack rows before `rows`, each level's features at them) of a prefill's `visual`."""
    if visual is None or not visual[1]:
        return torch.empty(0, dtype=torch.long), []
    keep = visual[0] < rows
    return visual[0][keep], [feat[keep] for feat in visual[1]]


class Decoders:
    """The model's three decoders, built once and kept with their caches and graphs for the engine's life."""

    def __init__(self, model, device: torch.device, compile: bool, profile: DeviceProfile):
        self.model, self.device, self.compile, self.profile = model, device, compile, profile
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
                                                          self.profile, self.compile))

    @property
    def talker(self) -> StaticDecoder:
        t = self.model.talker
        thinker_hidden = self.model.thinker.model.language_model.config.hidden_size
        return self._get("talker", lambda: StaticDecoder(
            t.model, t.codec_head, self.device, self.profile, self.compile,
            long_prefill_widen(thinker_hidden, t.model.config.hidden_size)))

    @property
    def code_predictor(self) -> CodePredictor:
        return self._get("code_predictor", lambda: CodePredictor(self.model, self.device, self.profile, self.compile))

    def defer_captures(self, defer: bool) -> None:
        """A server's: prefill graphs are captured while the GPU is idle (capture_deferred), not by a request."""
        self.thinker.policy.defer = self.talker.policy.defer = defer

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        return sum(dec.capture_deferred(stop) for dec in self._made.values() if isinstance(dec, StaticDecoder))

    def weights_may_have_moved(self) -> None:
        """After a swap: every decoder compares its weights' addresses with its graphs' before the next replay
        (re-capturing where they moved); the code predictor has no prefill that would check for it."""
        for dec in self._made.values():
            dec.runner.check = True

    def capture_count(self) -> int:
        """The CUDA graphs the decoders have captured (decode steps and prefill buckets), over their life."""
        return sum(d.runner.captures + getattr(d, "prefill_captures", 0) for d in self._made.values())

    def moe_backend(self) -> str | None:
        """The name of the MoE backend the thinker's INT4 experts run on (chosen when they were loaded)."""
        return moe_backend_name(self.model.thinker.model.language_model)

    def stats(self) -> dict:
        """Per decoder: CUDA-graph captures (and their seconds) and the torch.compile error, if compiling failed."""
        return {kind: {"captures": d.runner.captures, "capture_s": round(d.runner.capture_s, 4),
                       "prefill_captures": getattr(d, "prefill_captures", 0),
                       "compiled": d.runner.compile, "compile_error": d.runner.compile_error}
                for kind, d in self._made.items()}


__all__ = ["CodePredictor", "Decoders", "PrefillInputs", "Prefilled", "PrefillRoute", "StaticDecoder"]
