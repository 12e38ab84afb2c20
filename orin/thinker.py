"""The thinker's side of a request: the encoders' features merged into the prompt's embeddings with M-RoPE
positions, the prefill and the decode steps (orin.decode), sampling, and detokenization."""

from __future__ import annotations

from collections.abc import Callable

from .decode import Decoders
from .errors import ModelError


class Thinker:
    def __init__(self, model, config, device, dtype, decoders: Decoders):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.decoders = decoders

    def encode_audio(self, inputs: dict):
        return self.model.thinker.model.get_audio_features(
            inputs["input_features"].to(self.dtype), inputs["feature_attention_mask"], return_dict=True,
        ).last_hidden_state

    def encode_image(self, inputs: dict):
        return self.model.thinker.model.get_image_features(
            inputs["pixel_values"].to(self.dtype), inputs["image_grid_thw"], return_dict=True)

    def merge(self, inputs: dict, ids, audio_feats, image_out):
        """The thinker's input embeddings with the audio and image features merged, its M-RoPE positions
        (setting the rope deltas decoding continues from) and the image's deepstack features, as
        Qwen3OmniMoeThinkerModel.forward builds them before its language model."""
        import torch

        tm = self.model.thinker.model
        embeds = tm.get_input_embeddings()(ids)
        if audio_feats is not None:
            _, _, audio_mask = tm.get_placeholder_mask(ids, inputs_embeds=embeds)
            embeds = embeds.masked_scatter(audio_mask, audio_feats.to(embeds.dtype))
        visual = None
        if image_out is not None:
            image_embeds = torch.cat(image_out.pooler_output, dim=0).to(embeds.dtype)
            image_mask, _, _ = tm.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=image_embeds)
            embeds = embeds.masked_scatter(image_mask, image_embeds)
            visual = (image_mask[..., 0], [torch.cat(f, dim=0) for f in image_out.deepstack_features])
        fam = inputs.get("feature_attention_mask")
        tm.rope_deltas = None
        position_ids = tm.compute_3d_position_ids(
            input_ids=ids, image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=None, inputs_embeds=embeds,
            attention_mask=inputs["attention_mask"], past_key_values=None,
            audio_feature_lengths=fam.sum(dim=1) if fam is not None else None)
        return embeds, position_ids, visual

    def prefill(self, merged, max_len: int, keeps_weights: bool):
        """The merged prompt through the thinker: (its decoder, holding the prompt's KV cache; the hidden states
        {HF index: [1, T, H]} the talker reads; the last position's logits). The two talker layers are always
        recorded (two [T, H] copies), so text-only and speech requests share a prefill graph."""
        embeds, position_ids, visual = merged
        accept = self.config.talker_config.accept_hidden_layer
        dec = self.decoders.thinker
        out = dec.prefill(embeds[0], position_ids, max_len, record=(0, accept), visual=visual, graph=keeps_weights)
        return dec, out.states, out.logits

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


class TextEmbeddings:
    """The thinker's input embeddings of token ids, for the talker: from the table while the thinker is resident;
    when speech follows the text under a budget, the talker runs after the thinker (and its table) is swapped
    out, so the generated tokens' and the TTS specials' embeddings are kept first (`remember`)."""

    def __init__(self, model, config, device, is_resident: Callable[[str], bool]):
        self.model, self.config, self.device = model, config, device
        self.is_resident = is_resident
        self._kept: dict = {}

    def remember(self, tokens) -> None:
        import torch

        c = self.config
        ids = sorted(set(tokens) | {c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id})
        table = self.model.thinker.model.get_input_embeddings()(torch.tensor([ids], device=self.device))
        self._kept = {t: table[:, i:i + 1] for i, t in enumerate(ids)}

    def __call__(self, ids):
        """[1, n, H] for token ids [1, n]."""
        import torch

        if self.is_resident("thinker_text"):
            return self.model.thinker.model.get_input_embeddings()(ids)
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


__all__ = ["Detokenizer", "TextEmbeddings", "Thinker"]
