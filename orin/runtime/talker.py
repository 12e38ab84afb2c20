"""The talker and its code predictor for one request, one codec frame per step, fed the thinker's text step by
step. Input construction follows transformers' Qwen3OmniMoeForConditionalGeneration.generate for a single
sequence (the HF model is the tests' oracle); the decoding is orin.runtime.decode's."""

from __future__ import annotations

from collections.abc import Callable

from ..device.profile import PrefillTuning
from ..errors import ModelError
from .decode import Decoders, PrefillInputs
from .request_state import RequestState

# The code predictor's sampling when the talker samples, as HF's talker calls it (top_k 50, top_p 0.8).
CODE_TOP_K, CODE_TOP_P = 50, 0.8


def in_blocks(fn, x, rows: int):
    """fn over x [1, n, H] in blocks of `rows` rows, the last padded: every row comes out of a GEMM of the same
    shape, so the same bits in every prompt of its class (long or not) it is part of. A conversation's next turn
    then finds its earlier turns' talker rows unchanged, and its talker prefill reads them from the cache
    (orin.runtime.decode compares them bit for bit); one GEMM over all the rows could take another kernel as the prompt
    grows."""
    import torch
    import torch.nn.functional as F

    n = x.shape[1]
    pad = -n % rows
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return torch.cat([fn(x[:, i:i + rows]) for i in range(0, n + pad, rows)], dim=1)[:, :n]


class Talker:
    def __init__(self, model, config, device, decoders: Decoders, text_embeddings: Callable, state: RequestState,
                 prompt, thinker_hidden, on_cache: Callable[[int], None], prefill: PrefillTuning):
        """`prompt`: the request's orin.inputs.prompt.Prompt; thinker_hidden: the thinker prefill's
        `accept_hidden_layer` states [1, T, H]. The thinker's input embeddings the talker reads are its text
        rows' only, which are the embedding table's rows of their tokens (`text_embeddings`): no copy of a long
        prompt's input embeddings is recorded for it. `prefill`: the device profile's, for the projections'
        block rows."""
        self.model, self.config, self.device = model, config, device
        self.decoders = decoders
        self.text_embeddings = text_embeddings
        self.state = state
        self.prompt = prompt
        self.thinker_hidden = thinker_hidden
        self.on_cache = on_cache
        self.tuning = prefill
        self.step_index = 0
        self.finished = False
        self.generated: list[int] = []
        self.next_code = None
        self._frame_embeds = None  # the code predictor's sum for the frame made and not yet read by the talker
        self.past_hidden = None
        self.gen = None
        self.decoder = decoders.talker

    def _proj(self, embeds):
        return self.model.talker.text_projection(embeds)

    def _thinker_embed_of(self, token: int):
        import torch

        return self.text_embeddings(torch.tensor([[token]], device=self.device))

    def _user_part(self, host_ids):
        """The user turns' talker inputs and their ids: multimodal rows from the thinker's hidden states
        (hidden_projection), text rows from its input embeddings (text_projection), as
        Qwen3OmniMoeForConditionalGeneration._get_talker_user_parts lays them out; the row sets are found on
        the host (the prompt's ids), so nothing here waits on the device."""
        import torch

        cfg, th = self.config, self.config.thinker_config
        t = self.model.talker
        seq_len = host_ids.shape[0]
        mm = (host_ids == th.audio_token_id) | (host_ids == th.image_token_id) | (host_ids == th.video_token_id)
        positions = torch.arange(seq_len)
        im_start = torch.where(host_ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
        prev = torch.cummax(im_start, dim=0).values.clamp_min(0)
        roles = host_ids[(prev + 1).clamp_max(seq_len - 1)]
        user_rows = torch.nonzero(roles == cfg.user_token_id).flatten()
        full = torch.empty((1, seq_len, cfg.talker_config.text_config.hidden_size), device=self.device,
                           dtype=t.codec_head.weight.dtype)
        mm_rows = torch.nonzero(mm).flatten().to(self.device)
        text_rows = torch.nonzero(~mm).flatten().to(self.device)
        # A long prompt's (a video's) projections on larger blocks: 64-row ones are over a thousand launches there.
        tune = self.tuning
        block = tune.long_projection_rows if seq_len > tune.long_prefill_tokens else tune.projection_rows
        if mm_rows.numel():
            full.index_copy_(1, mm_rows, in_blocks(t.hidden_projection, self.thinker_hidden.index_select(1, mm_rows),
                                                   block))
        text_ids = host_ids[~mm].view(1, -1).to(self.device)
        full.index_copy_(1, text_rows, in_blocks(t.text_projection, self.text_embeddings(text_ids), block))
        return full.index_select(1, user_rows.to(self.device)), host_ids[user_rows]

    def _assistant_part(self, host_ids, a_start: int, speaker_id: int, bos, pad):
        """The assistant turn's opening talker inputs (its first three text rows, four pads, tts_bos and the
        first generated token, over the codec's think/speaker/bos specials) and their ids, as
        _get_talker_assistant_parts builds them."""
        import torch

        cfg, tk = self.config, self.config.talker_config
        t = self.model.talker
        first = self._thinker_embed_of(self.state.tokens[0])
        embed_all = torch.cat([self.text_embeddings(host_ids[a_start:].view(1, -1).to(self.device)), first], dim=1)
        hidden = self._proj(embed_all)
        text = torch.cat((hidden[:, :3], pad.expand(1, 4, -1), bos, hidden[:, 3:4]), dim=1)
        specials = torch.tensor([[tk.codec_nothink_id, tk.codec_think_bos_id, tk.codec_think_eos_id, speaker_id,
                                  tk.codec_pad_id, tk.codec_bos_id]], device=self.device)
        codec = torch.cat((torch.zeros((1, 3, text.shape[-1]), device=self.device, dtype=text.dtype),
                           t.model.codec_embedding(specials)), dim=1)
        return text + codec, torch.full((text.shape[1],), cfg.tts_pad_token_id, dtype=torch.long)

    def prefill(self, graph: bool) -> None:
        import torch

        from ..model.positions import mrope_positions, talker_spec

        cfg, req = self.config, self.state.req
        self.gen = torch.Generator(device="cpu").manual_seed(req.seed + 1)
        host_ids = self.prompt.input_ids.reshape(-1).cpu()
        user_embeds, user_ids = self._user_part(host_ids)
        starts = torch.nonzero((host_ids[:-1] == cfg.im_start_token_id) & (host_ids[1:] == cfg.assistant_token_id))
        if len(starts) == 0:
            raise ModelError("the prompt has no assistant turn; the chat template must add the generation prompt")
        specials = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]],
                                device=self.device)
        bos, eos, pad = self._proj(self.text_embeddings(specials)).chunk(3, dim=1)
        self.tts_eos, self.tts_pad = eos, pad
        speaker_id = cfg.talker_config.speaker_id[req.voice.lower()]
        a_embeds, a_ids = self._assistant_part(host_ids, int(starts.flatten()[-1]), speaker_id, bos, pad)
        embeds = torch.cat([user_embeds, a_embeds], dim=1)
        positions, delta = mrope_positions(torch.cat([user_ids, a_ids]), talker_spec(cfg.raw),
                                           image_grid_thw=self.prompt.image_grids or None,
                                           video_grid_thw=self.prompt.video_grids or None,
                                           video_second_per_grid=self.prompt.video_seconds or None,
                                           audio_lengths=self.prompt.audio_lengths or None)
        res = self.decoder.prefill(PrefillInputs(embeds[0], positions.to(self.device),
                                                 int(embeds.shape[1]) + req.frame_cap + 2,
                                                 rope_delta=int(delta.reshape(-1)[0])),
                                   graph=graph, continues=req.continues)
        self._after_forward(res.logits, res.hidden)

    def _after_forward(self, logits, hidden) -> None:
        self.past_hidden = hidden.reshape(1, 1, -1)
        code = self._choose(logits)
        self.generated.append(code)
        if code == self.config.talker_config.codec_eos_token_id or len(self.generated) > self.state.req.frame_cap:
            self.finished = True
        self.next_code = code
        self.on_cache(self.decoder.cache_bytes())

    def _choose(self, logits) -> int:
        import torch

        tk = self.config.talker_config
        vocab = tk.text_config.vocab_size
        logits = logits.float().clone()
        if self.generated:
            prev = torch.tensor(sorted(set(self.generated)), device=logits.device)
            score = logits[:, prev]
            logits[:, prev] = torch.where(score < 0, score * 1.05, score / 1.05)
        suppress = torch.arange(vocab - 1024, vocab, device=logits.device)
        suppress = suppress[suppress != tk.codec_eos_token_id]
        logits[:, suppress] = -float("inf")
        if self.state.req.ignore_eos:  # fixed lengths: speech ends at max_audio_frames, as HF's min_new_tokens does
            logits[:, tk.codec_eos_token_id] = -float("inf")
        temp = self.state.req.talker_temperature
        if temp <= 0:
            return int(torch.argmax(logits, dim=-1)[0])
        logits = logits / temp
        kth = torch.topk(logits, 50, dim=-1).values[:, -1:]
        logits[logits < kth] = -float("inf")
        probs = torch.softmax(logits, dim=-1)[0].cpu()
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def _sample_code(self, logits):
        """A residual code, sampled as HF's code predictor does when the talker samples (top-k, then top-p)."""
        import torch

        probs = torch.softmax(logits.float(), dim=-1)[0]
        top_p, top_i = torch.topk(probs, min(CODE_TOP_K, probs.numel()))
        keep = torch.cumsum(top_p, 0) - top_p < CODE_TOP_P
        top_p, top_i = top_p[keep], top_i[keep]
        pick = torch.multinomial((top_p / top_p.sum()).cpu(), 1, generator=self.gen)
        return top_i[pick.to(top_i.device)]

    @property
    def frame_due(self) -> bool:
        """Whether `frame` comes next: the talker chose a frame's first code and its frame is not made yet."""
        return not self.finished and self._frame_embeds is None

    def frame(self):
        """The next codec frame (on the host): the code predictor fills the residual groups of the frame whose
        first code the talker chose. It needs no text, so the frame goes to the vocoder before the thinker's
        next token exists (the first audio waited for a thinker step, a talker step and a sync)."""
        import torch

        code = torch.tensor([[self.next_code]], device=self.device)
        last_id_hidden = self.model.talker.model.codec_embedding(code)
        choose = self._sample_code if self.state.req.talker_temperature > 0 else None
        codes, self._frame_embeds = self.decoders.code_predictor.run(self.past_hidden, last_id_hidden, choose)
        return torch.cat((code[0], codes)).cpu()

    def advance(self, text) -> None:
        """The talker reads the frame `frame` made plus the next text position (`text`: ("token", id),
        ("eos", None) or ("pad", None)) and chooses the next frame's first code."""
        if self._frame_embeds is None:
            raise RuntimeError("Talker.advance before Talker.frame: the frame it reads is not made")
        embeds, self._frame_embeds = self._frame_embeds, None
        kind, token = text
        if kind == "token":
            embeds = embeds + self._proj(self._thinker_embed_of(token))
        elif kind == "eos":
            embeds = embeds + self.tts_eos
        else:
            embeds = embeds + self.tts_pad
        logits, hidden = self.decoder.step_embeds(embeds)
        self.step_index += 1
        self._after_forward(logits, hidden)
