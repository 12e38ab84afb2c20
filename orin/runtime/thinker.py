"""The thinker's side of a request: the encoders' features (audio, images, videos) merged into the prompt's embeddings with M-RoPE
positions, the prefill and the decode steps (orin.runtime.decode), sampling, and detokenization."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from ..device.profile import DeviceProfile
from ..errors import ModelError
from .decode import Decoders, PrefillInputs


class AudioTokenCache:
    """The audio encoder's tokens of recent audios, keyed by a digest of their samples (Prompt.audio_keys), least
    recently used dropped first past `limit` bytes (the profile's memory.audio_token_cache_bytes). The same audio in another turn's batch finds its
    tokens; they were computed from its features in that batch, which differ in the last frames (the batch's
    padding reaches the STFT windows past an audio's end) and in rounding on a GPU: the encoder's result up to
    that."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict[bytes, object] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.last: dict = {}  # the last call's host seconds (Thinker.encode_audio)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes):
        self._items.move_to_end(key)
        self.hits += 1
        return self._items[key]

    def put(self, key: bytes, tokens) -> None:
        if key in self._items:
            return
        size = tokens.numel() * tokens.element_size()
        if size > self.limit:
            return
        self._items[key] = tokens.clone()  # not a view of the batch's output: that would keep the whole batch
        self._bytes += size
        while self._bytes > self.limit:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()


class Thinker:
    def __init__(self, model, config, device, dtype, decoders: Decoders, profile: DeviceProfile):
        from ..model.positions import thinker_spec
        from .encoder_graphs import EncoderGraphs

        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.decoders = decoders
        self.profile = profile
        self.spec = thinker_spec(config.raw)
        self.encoder_graphs = EncoderGraphs(device, profile.capture)
        self.audio_tokens = AudioTokenCache(profile.memory.audio_token_cache_bytes)

    def encode_audio(self, inputs: dict, prompt, graph: bool = False):
        """The audio encoder's tokens [n, H] of every audio of the prompt, in order; the feature lengths come
        from the host (prompt.audio_lengths), so planning the encoder costs no device sync. `graph`: replayed
        from a CUDA graph per input shape (orin.runtime.encoder_graphs; the caller's word that the weights stay put).

        Each audio's tokens are kept (AudioTokenCache, keyed by its samples) and only the audios not seen
        before are encoded, each on its own: a Realtime conversation's prompt holds every turn's audio, and
        re-encoding all of it each turn cost more than the new turn's prefill. The encoder treats each audio on
        its own (windows within an audio), so the tokens are those of a batch's pass up to its GEMMs' rounding."""
        import torch

        tower = self.model.thinker.model.audio_tower
        feats, lengths = inputs["input_features"], tuple(prompt.audio_lengths)
        if feats.dim() != 3:
            plan = tower.plan(lengths, None, feats.device)
            return self.encoder_graphs.run(("audio", tuple(feats.shape), feats.dtype, lengths), tower, (feats,),
                                           lambda f: tower(f, lengths), graph, keep=plan)
        start = time.perf_counter()
        keys = list(prompt.audio_keys)
        missing = [i for i, key in enumerate(keys) if key not in self.audio_tokens]
        keyed = time.perf_counter()
        fresh = {}
        for i in missing:  # each on its own: no padded batch (whose masked attention cost ~7x), no batch effects
            n = (lengths[i],)
            sub = feats[i:i + 1, :, :lengths[i]].contiguous()
            plan = tower.plan(n, lengths[i], sub.device)
            fresh[keys[i]] = self.encoder_graphs.run(("audio", tuple(sub.shape), sub.dtype, n), tower, (sub,),
                                                     lambda f, n=n: tower(f, n), graph, keep=plan)
        pieces = [fresh[key] if key in fresh else self.audio_tokens.get(key) for key in keys]
        for key, piece in fresh.items():
            self.audio_tokens.put(key, piece)
        # host seconds: the cache lookups and the encoder's
        # launches (the bench's realtime case reports them)
        self.audio_tokens.last = {"key_s": keyed - start, "encode_s": time.perf_counter() - keyed,
                                  "audios": len(keys), "encoded": len(missing)}
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def encode_image(self, inputs: dict, prompt, graph: bool = False):
        """orin.model.vision_encoder.VisionFeatures of every image of the prompt, from the host-side grids."""
        visual = self.model.thinker.model.visual
        pixels, grids = inputs["pixel_values"].to(self.dtype), prompt.image_grids
        plan = visual.plan(grids, pixels.device)
        return self.encoder_graphs.run(("image", tuple(pixels.shape), grids), visual, (pixels,),
                                       lambda p: visual(p, plan), graph, keep=plan)

    def encode_video(self, prompt):
        """orin.model.vision_encoder.VisionFeatures of every video of the prompt, videos one after another. The
        encoder attends within each temporal grid only, so a clip goes through it a few grids at a time
        (orin.memory.request_sizes.video_passes: the profile's prefill.video_encode_patches patches at most, whole grids) with the
        same result (up to the GEMMs' rounding), each pass's pixel values patchified from the clip's frames when
        the pass runs (prompt.video_pixels): the activations and pixel values alive are those of a few frames
        however long the clip. No CUDA graph: a clip's shape rarely comes again."""
        import torch

        from ..memory.request_sizes import video_passes
        from ..model.vision_encoder import VisionFeatures

        visual = self.model.thinker.model.visual
        lazy, grids = prompt.video_pixels, prompt.video_grids
        embeds, deepstack = [], []
        for v, first, last in video_passes(grids, self.profile.prefill.video_encode_patches):
            grid = (last - first, grids[v][1], grids[v][2])
            pixels = lazy.patches(v, first, last, self.device).to(self.dtype)
            out = visual(pixels, visual.plan((grid,), self.device))
            del pixels
            embeds.append(out.embeds)
            deepstack.append(out.deepstack)
        return VisionFeatures(torch.cat(embeds), [torch.cat(level) for level in zip(*deepstack, strict=True)])

    def merge(self, inputs: dict, prompt, audio_feats, image_feats, video_feats=None):
        """The thinker's input embeddings with the audio, image and video features in their placeholders' rows,
        its M-RoPE positions and rope delta (orin.model.positions, on the host from the prompt's ids, grids, seconds
        per grid and audio lengths), and the visual tokens' deepstack rows and features (images' and videos'
        rows together, as transformers joins them)."""
        import torch

        from ..model.positions import mrope_positions

        th = self.config.thinker_config
        ids = inputs["input_ids"]
        embeds = self.model.thinker.model.language_model.embed_tokens(ids)
        host_ids = prompt.input_ids.reshape(-1)
        if audio_feats is not None:
            embeds = _scatter_rows(embeds, host_ids == th.audio_token_id, audio_feats, "audio")
        rows, deepstack = [], []
        for feats, token, kind in ((image_feats, th.image_token_id, "image"), (video_feats, th.video_token_id,
                                                                                 "video")):
            if feats is None:
                continue
            mask = host_ids == token
            embeds = _scatter_rows(embeds, mask, feats.embeds, kind)
            rows.append(torch.nonzero(mask).flatten().to(self.device))
            deepstack.append(feats.deepstack)
        # the prefill copies each level's features into their rows: images' and videos' may simply follow
        # each other
        visual = (torch.cat(rows), [torch.cat(level) for level in zip(*deepstack, strict=True)]) if rows else None
        positions, delta = mrope_positions(prompt.input_ids, self.spec,
                                           image_grid_thw=prompt.image_grids or None,
                                           video_grid_thw=prompt.video_grids or None,
                                           video_second_per_grid=prompt.video_seconds or None,
                                           audio_lengths=prompt.audio_lengths or None)
        return embeds, positions.to(self.device), int(delta.reshape(-1)[0]), visual

    def prefill(self, merged, max_len: int, graph: bool, continues: bool = False):
        """The merged prompt through the thinker: (its decoder, holding the prompt's KV cache; the hidden states
        {HF index: [1, T, H]} the talker reads; the last position's logits). The talker's layer is always
        recorded, so text-only and speech requests share a prefill graph. `graph`: the thinker's weights stay
        put (StaticDecoder.prefill). `continues`: a
        conversation's next turn (StaticDecoder.prefill). The merged embeddings are the prefill's to overwrite
        (a long prompt's are, where it holds nothing for a next turn)."""
        embeds, position_ids, delta, visual = merged
        dec = self.decoders.thinker
        out = dec.prefill(PrefillInputs(embeds[0], position_ids, max_len, self._record(), visual, delta),
                          graph=graph, continues=continues)
        return dec, out.states, out.logits

    def _record(self) -> tuple[int, ...]:
        talker = self.config.talker_config
        return (talker.accept_hidden_layer,) if talker is not None else ()

    def expect_conversation(self, rows: tuple[int, int], answer: int) -> None:
        """A conversation's first prompt of `rows` (least, most) is coming, its answer up to `answer` tokens: its
        prefill graphs are wanted first at the next idle captures (CapturePolicy.expect)."""
        dec = self.decoders.thinker
        dec.policy.expect(rows[0], rows[1], self._record(), answer, dec.max_len)

    @staticmethod
    def sample(logits, temperature: float, top_p: float, gen) -> int:
        import torch

        if temperature <= 0:
            return int(torch.argmax(logits, dim=-1)[0])
        probs = torch.softmax(logits.float() / temperature, dim=-1)[0].cpu()
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _scatter_rows(embeds, host_mask, features, kind: str):
    """`features` [n, H] into the rows of embeds [1, T, H] where `host_mask` [T] (a CPU tensor) is set."""
    import torch

    rows = torch.nonzero(host_mask).flatten()
    if rows.numel() != features.shape[0]:
        raise ModelError(f"the prompt has {rows.numel()} {kind} placeholder tokens but the {kind} encoder gave "
                         f"{features.shape[0]} features; the processor and the model config disagree")
    return embeds.index_copy(1, rows.to(embeds.device), features.to(embeds.dtype).unsqueeze(0))


class TextEmbeddings:
    """The thinker's input embeddings of token ids, for the talker: from the table while the thinker is resident;
    when speech follows the text under a budget, the talker runs after the thinker (and its table) is swapped
    out, so the generated tokens' and the TTS specials' embeddings are kept first (`remember`)."""

    def __init__(self, model, config, device, is_resident: Callable[[str], bool]):
        self.model, self.config, self.device = model, config, device
        self.is_resident = is_resident
        self._kept: dict = {}

    def _table(self):
        return self.model.thinker.model.language_model.embed_tokens

    def remember(self, tokens) -> None:
        import torch

        c = self.config
        ids = sorted(set(tokens) | {c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id})
        table = self._table()(torch.tensor([ids], device=self.device))
        self._kept = {t: table[:, i:i + 1] for i, t in enumerate(ids)}

    def __call__(self, ids):
        """[1, n, H] for token ids [1, n]."""
        import torch

        if self.is_resident("thinker_text"):
            return self._table()(ids)
        try:
            return torch.cat([self._kept[int(t)] for t in ids.reshape(-1).tolist()], dim=1)
        except KeyError as exc:
            raise ModelError(f"token {exc} has no remembered embedding while the thinker is swapped out") from exc


class Detokenizer:
    """Incremental detokenization that never emits half a UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        # Trailing replacement characters may be the start of a multi-byte character: hold them back.
        text = self.tok.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta




def next_turn_rows(config, tokenizer, prompt, answer: list[int]) -> int:
    """The rows a conversation's next turn will likely prefill after this prompt's: this answer as the next prompt
    holds it (its text tokenized again: the tokens a model samples are not always those its tokenizer gives the
    text, and a random model's decode to bytes that tokenize six times longer), its end-of-turn tokens
    (<|im_end|>, a newline), then a user turn as long as this prompt's last one (from its <|im_start|> to the end,
    the assistant's header included)."""
    ids = prompt.input_ids.reshape(-1).tolist()
    starts = [i for i, t in enumerate(ids) if t == config.im_start_token_id]
    question = len(ids) - (starts[-2] if len(starts) > 1 else 0)
    text = tokenizer.decode(answer, skip_special_tokens=True)
    return len(tokenizer.encode(text)) + 2 + question


__all__ = ["Detokenizer", "TextEmbeddings", "Thinker", "next_turn_rows"]
