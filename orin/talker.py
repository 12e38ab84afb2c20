"""The talker and its code predictor for one request, one codec frame per step, fed the thinker's text step by
step. Input construction follows Qwen3OmniMoeForConditionalGeneration.generate for a single sequence; the
decoding is orin.decode's."""

from __future__ import annotations

from collections.abc import Callable

from .decode import Decoders
from .errors import ModelError
from .request_state import RequestState

# The code predictor's sampling when the talker samples, as HF's talker calls it (top_k 50, top_p 0.8).
CODE_TOP_K, CODE_TOP_P = 50, 0.8


class Talker:
    def __init__(self, model, config, device, decoders: Decoders, text_embeddings: Callable, state: RequestState,
                 prompt_inputs: dict, thinker_embed, thinker_hidden, on_cache: Callable[[int], None]):
        self.model, self.config, self.device = model, config, device
        self.decoders = decoders
        self.text_embeddings = text_embeddings
        self.state = state
        self.ids = prompt_inputs["input_ids"]
        self.inputs = prompt_inputs
        self.thinker_embed = thinker_embed
        self.thinker_hidden = thinker_hidden
        self.on_cache = on_cache
        self.step_index = 0
        self.finished = False
        self.generated: list[int] = []
        self.next_code = None
        self.past_hidden = None
        self.gen = None
        self.decoder = decoders.talker

    def _proj(self, embeds):
        return self.model.talker.text_projection(embeds)

    def _thinker_embed_of(self, token: int):
        import torch

        return self.text_embeddings(torch.tensor([[token]], device=self.device))

    def prefill(self, keeps_weights: bool) -> None:
        import torch

        model, cfg = self.model, self.config
        ids = self.ids
        tk = cfg.talker_config
        req = self.state.req
        self.gen = torch.Generator(device="cpu").manual_seed(req.seed + 1)
        seq_len = ids.shape[1]
        th = cfg.thinker_config
        mm_mask = (ids == th.audio_token_id) | (ids == th.image_token_id) | (ids == th.video_token_id)
        positions = torch.arange(seq_len, device=ids.device).unsqueeze(0)
        im_start = torch.where(ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
        prev = torch.cummax(im_start, dim=-1).values.clamp_min(0)
        roles = ids.gather(1, (prev + 1).clamp_max(seq_len - 1))
        user_idx = torch.nonzero((roles == cfg.user_token_id)[0]).flatten()
        full_user = model._get_talker_user_parts(0, seq_len, mm_mask, self.thinker_hidden, self.thinker_embed)
        user_embeds = full_user[:, user_idx]
        user_ids = ids[:, user_idx]
        starts = torch.nonzero((ids[0, :-1] == cfg.im_start_token_id) & (ids[0, 1:] == cfg.assistant_token_id))
        if len(starts) == 0:
            raise ModelError("the prompt has no assistant turn; the chat template must add the generation prompt")
        a_start = int(starts.flatten()[-1])
        specials = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]],
                                device=ids.device)
        bos, eos, pad = self._proj(self.text_embeddings(specials)).chunk(3, dim=1)
        self.tts_eos, self.tts_pad = eos, pad
        first = self._thinker_embed_of(self.state.tokens[0])
        embed_all = torch.cat([self.thinker_embed, first], dim=1)
        speaker_id = tk.speaker_id[req.voice.lower()]
        a_embeds, a_ids, _ = model._get_talker_assistant_parts(a_start, seq_len + 1, speaker_id, embed_all,
                                                               pad, bos, eos)
        embeds = torch.cat([user_embeds, a_embeds], dim=1)
        talker_ids = torch.cat([user_ids, a_ids], dim=1)
        fam = self.inputs.get("feature_attention_mask")
        model.talker.rope_deltas = None
        position_ids = model.talker.compute_3d_position_ids(
            embeds, talker_input_ids=talker_ids, attention_mask=torch.ones_like(talker_ids), past_key_values=None,
            image_grid_thw=self.inputs.get("image_grid_thw"),
            audio_feature_lengths=fam.sum(dim=1) if fam is not None else None)
        res = self.decoder.prefill(embeds[0], position_ids, int(embeds.shape[1]) + req.frame_cap + 2,
                                   graph=keeps_weights)
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

    def step(self, text) -> object:
        """One codec frame: the code predictor fills the residual groups of the frame whose first code the
        talker chose, then the talker reads that frame plus the next text position (`text`: ("token", id),
        ("eos", None) or ("pad", None))."""
        import torch

        code = torch.tensor([[self.next_code]], device=self.device)
        last_id_hidden = self.model.talker.get_input_embeddings()(code)
        choose = self._sample_code if self.state.req.talker_temperature > 0 else None
        codes, embeds = self.decoders.code_predictor.run(self.past_hidden, last_id_hidden, choose)
        frame = torch.cat((code[0], codes))
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
        return frame.cpu()
