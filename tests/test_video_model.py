"""Video through the model (issue 16) on the tiny quantized model, CPU: the processor's video patches and
audio-in-video tokens against transformers' layout, and the engine's video prefill, positions, text and speech
against transformers' Qwen3-Omni on the very same weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from module_oracle import hf_twin

from orin.contract import AudioChunk, Done, GenerationRequest, TextDelta
from orin.inputs.media import synth_image, synth_speechlike
from orin.inputs.processor import Processor
from orin.inputs.video import Video, VideoOptions, load_video, synth_clip
from orin.inputs.video_patches import audio_in_video


@pytest.fixture(scope="module")
def clip_video() -> Video:
    """3 s at 2 fps of a 96x128 clip with its soundtrack: 6 frames, 3 temporal grids of 6x8 patches."""
    return load_video(synth_clip(3.0, 10, (96, 128), seed=3), VideoOptions(fps=2.0))


def _messages(video, *, image: bool = False, audio: bool = False, text: str = "What happens in this clip?"):
    parts = [{"type": "video", "video": video}]
    if image:
        parts.insert(0, {"type": "image", "image": synth_image(64, seed=4)})
    if audio:
        parts.append({"type": "audio", "audio": synth_speechlike(1.5, seed=5)})
    return ({"role": "user", "content": parts + [{"type": "text", "text": text}]},)


def _hf_patches(frames: np.ndarray, table: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """Qwen2-VL's video processor's patch layout, as transformers writes it (channels first, frames padded by
    repeating the last, the (0, 3, 6, 4, 7, 2, 1, 5, 8) transpose)."""
    x = np.stack([table[c][frames[..., c]] for c in range(3)], axis=1)  # [T, C, H, W]
    if len(x) % temporal:
        x = np.concatenate([x, np.repeat(x[-1:], temporal - len(x) % temporal, axis=0)])
    t, c, h, w = x.shape
    gt, gh, gw = t // temporal, h // patch, w // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal * patch * patch)


def test_video_patches_have_transformers_layout(quantized_dir):
    from orin.inputs.image_patches import value_table

    proc = Processor.from_dir(quantized_dir)
    s = proc.patcher.settings
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)  # odd: the last frame repeats
    video = Video(frames, 2.5, tuple(np.arange(5) / 2.5), 2.0, None, {})
    out = proc.video_patcher([video])
    table = value_table(s.do_rescale, s.rescale_factor, s.do_normalize, s.image_mean, s.image_std)
    ref = _hf_patches(frames, table, s.patch_size, s.merge_size, s.temporal_patch_size)
    assert out.video_grid_thw.tolist() == [[3, 4, 6]] and out.second_per_grid == (0.8,)
    assert out.token_counts == (3 * 4 * 6 // 4,)
    assert torch.equal(out.pixel_values, torch.from_numpy(ref))
    half = proc.video_patcher([video], dtype=torch.bfloat16)
    assert torch.equal(half.pixel_values, out.pixel_values.to(torch.bfloat16))


@pytest.mark.parametrize("spg", [0.5, 2 / 3, 1.0, 2.0])
@pytest.mark.parametrize("n_audio", [0, 5, 39, 200])
def test_audio_in_video_order_is_transformers(spg, n_audio):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    class Stub:
        audio_bos_token, audio_eos_token, video_token, audio_token = "S", "E", "V", "A"

        class video_processor:  # noqa: N801 - transformers' attribute name
            merge_size = 2

    grid = (7, 4, 6)
    ref = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        Stub(), {"video_grid_thw": torch.tensor([grid]), "video_second_per_grid": [spg]}, 0,
        {"num_audio_tokens": [n_audio]}, 0, position_id_per_seconds=13)
    ours = "".join("V" if v else "A" for v in audio_in_video(grid, 2, spg, 13, n_audio))
    assert ref == f"S{ours}E"


def test_prompt_tokens_of_a_video_with_its_audio(quantized_dir, clip_video):
    proc = Processor.from_dir(quantized_dir)
    inputs = proc.prepare(_messages(clip_video, audio=True))
    ids = inputs["input_ids"][0].tolist()
    grids = inputs["video_grid_thw"].tolist()
    assert grids == [[3, 6, 8]] and inputs["video_second_per_grid"].tolist() == [1.0]
    assert ids.count(proc.video_token_id) == 3 * 6 * 8 // 4
    # two audios, in the prompt's order: the clip's soundtrack (3 s) then the audio part (1.5 s)
    assert inputs["feature_attention_mask"].sum(1).tolist() == [300, 150]
    start = ids.index(proc.placeholder_ids["audio_bos_token"])
    assert ids[start - 1] == proc.tokenizer.token_id("<|vision_start|>")
    assert ids[start + 1:start + 13] == [proc.video_token_id] * 12  # grid 0 at t = 0 goes first
    no_audio = proc.prepare(_messages(Video(**{**clip_video.__dict__, "audio": None})))
    assert "input_features" not in no_audio
    assert no_audio["input_ids"][0].tolist().count(proc.audio_token_id) == 0


def _collect(engine, req):
    events = list(engine.stream(req))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    frames = [f for e in events if isinstance(e, AudioChunk) for f in e.frames]
    return text, frames, next(e.report for e in events if isinstance(e, Done))


@pytest.mark.parametrize("media", [dict(), dict(image=True, audio=True)], ids=["video+audio", "image+video+audio"])
def test_video_request_matches_transformers(engine, clip_video, media):
    """Text tokens and speech codes as transformers' generate() gives them for the same clip, soundtrack
    interleaved (use_audio_in_video), on the engine's own weights; the prefill's positions and logits too."""
    req = GenerationRequest(messages=_messages(clip_video, **media), max_new_tokens=6, max_audio_frames=400,
                            ignore_eos=False)
    text, frames, report = _collect(engine, req)
    assert report.prompt_tokens > 0 and frames
    prompt = engine.prepare(req)
    assert prompt.has_video and prompt.n_video_tokens == 36
    # the engine patchifies each encoder pass's frames itself; transformers takes the whole clip's pixel values
    given = {**prompt.inputs, "pixel_values_videos": prompt.video_pixels.whole("cpu")}
    inputs = {k: (v.to(engine.dtype) if torch.is_floating_point(v) and k != "video_second_per_grid" else v)
              for k, v in given.items()}
    model = hf_twin(engine.model, engine.cfg.model_dir)
    with torch.inference_mode():
        seq, _ = model.generate(
            **inputs, use_audio_in_video=True, return_audio=True, speaker="ethan", thinker_max_new_tokens=6,
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=report.talker_frames + 1,
            thinker_eos_token_id=engine.config.im_end_token_id)
        hf_out = model.thinker(**inputs, use_audio_in_video=True)
        merged = engine.thinker.merge(inputs, prompt, *_features(engine, inputs, prompt))
        _, _, logits = engine.thinker.prefill(merged, prompt.length + 1, graph=False)
        hf_pos, hf_delta = model.thinker.model.get_rope_index(
            inputs["input_ids"], inputs.get("image_grid_thw"), inputs["video_grid_thw"], inputs["attention_mask"],
            True, inputs["feature_attention_mask"].sum(1), inputs["video_second_per_grid"])
    n = prompt.input_ids.shape[1]
    assert tuple(seq[0, n:].tolist()) == report.token_ids
    assert torch.equal(merged[1].cpu(), hf_pos.float()) and merged[2] == int(hf_delta.reshape(-1)[0])
    torch.testing.assert_close(logits.float().reshape(-1), hf_out.logits[0, -1].float(), atol=2e-2, rtol=2e-2)
    assert text == report.text


def _engine_with(model_dir: str, base, **groups):
    """A CPU engine on the tiny checkpoint whose device profile is `base` with some tuning numbers changed:
    groups={"prefill": {"long_prefill_tokens": 37}, ...} (orin.device.profile's group names)."""
    from orin.runtime.engine import Engine, EngineConfig

    profile = replace(base, **{g: replace(getattr(base, g), **values) for g, values in groups.items()})
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", power_backend="none", profile=profile))


def _features(engine, inputs, prompt):
    th = engine.thinker
    audio = th.encode_audio(inputs, prompt) if prompt.has_audio else None
    image = th.encode_image(inputs, prompt) if prompt.has_image else None
    return audio, image, th.encode_video(prompt) if prompt.has_video else None


def test_video_is_encoded_a_few_grids_at_a_time(engine, clip_video, quantized_dir, monkeypatch):
    prompt = engine.prepare(GenerationRequest(messages=_messages(clip_video)))
    whole = engine.thinker.encode_video(prompt)
    small = _engine_with(quantized_dir, engine.profile, prefill={"video_encode_patches": 48})  # one grid a pass
    try:
        calls = []
        visual = small.model.thinker.model.visual
        original = type(visual).forward
        monkeypatch.setattr(type(visual), "forward", lambda self, px, plan: calls.append(px.shape[0]) or
                            original(self, px, plan))
        req = GenerationRequest(messages=_messages(clip_video), max_new_tokens=1, speech=False)
        _collect(small, req)  # the vision encoder resident, as a request leaves it
        calls.clear()
        pieces = small.thinker.encode_video(small.prepare(req))
    finally:
        small.close()
    assert calls == [48, 48, 48]
    # the same sums, but GEMMs over fewer rows may round differently in the last bits
    torch.testing.assert_close(pieces.embeds, whole.embeds, atol=1e-5, rtol=1e-4)
    for a, b in zip(pieces.deepstack, whole.deepstack, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_engines_prompt_holds_frames_not_pixel_values(engine, clip_video):
    """The engine's prompt keeps the clip's frames and patchifies each encoder pass's grids when it runs: the
    rows are the processor's pixel values bit for bit, and no whole-clip pixel values are made."""
    prompt = engine.prepare(GenerationRequest(messages=_messages(clip_video)))
    assert "pixel_values_videos" not in prompt.inputs
    lazy = prompt.video_pixels
    want = Processor.from_dir(engine.cfg.model_dir).prepare(_messages(clip_video),
                                                            video_dtype=lazy.dtype)["pixel_values_videos"]
    t, h, w = lazy.grids[0]
    assert torch.equal(lazy.whole("cpu"), want)
    assert torch.equal(lazy.patches(0, 1, 3, "cpu"), want[h * w:3 * h * w])


def test_generate_cli_answers_a_video_with_its_soundtrack(quantized_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from orin.cli import cli

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(synth_clip(3.0, 10, (64, 64), seed=6))
    base = ["generate", quantized_dir, "--video", str(clip), "--text", "What happens?", "--max-new-tokens", "3",
            "--device", "cpu", "--power-backend", "none", "--json"]
    runner = CliRunner()
    tokens = {}
    for args in ([], ["--no-video-audio"], ["--fps", "1"]):
        res = runner.invoke(cli, base + args)
        assert res.exit_code == 0, res.output + res.stderr
        report = json.loads(res.stdout)
        assert report["completion_tokens"] >= 1
        tokens[" ".join(args)] = report["prompt_tokens"]
    # 6 frames at 2 fps: 3 grids of 2x2 merged tokens; the soundtrack's 3 s are 39 audio tokens and 2 markers
    assert tokens[""] - tokens["--no-video-audio"] == 39 + 2
    assert tokens[""] - tokens["--fps 1"] == 3 * 4 - 2 * 4  # 4 frames (the minimum) at 1 fps: 2 grids


@pytest.mark.parametrize("args, message", [
    (["--fps", "0"], "fps 0"),
    (["--max-video-seconds", "1"], "over the 1 s limit"),
])
def test_generate_cli_refuses_bad_video_options(quantized_dir, tmp_path, args, message):
    from click.testing import CliRunner

    from orin.cli import cli

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(synth_clip(3.0, 10, (64, 64), seed=6))
    res = CliRunner().invoke(cli, ["generate", quantized_dir, "--video", str(clip), "--device", "cpu", *args])
    assert res.exit_code != 0 and message in res.output


def test_generate_cli_refuses_what_is_not_a_video(quantized_dir, tmp_path):
    from click.testing import CliRunner

    from orin.cli import cli
    from orin.inputs.media import encode_wav

    for name, content, message in (("notes.mp4", b"plain text, not a video", "not"),
                                   ("voice.wav", encode_wav(synth_speechlike(1.0)), "no video stream"),
                                   ("cut.mp4", synth_clip(3.0, 10, (64, 64), seed=6)[:3000], "")):
        bad = tmp_path / name
        bad.write_bytes(content)
        res = CliRunner().invoke(cli, ["generate", quantized_dir, "--video", str(bad), "--device", "cpu"])
        assert res.exit_code != 0 and name in res.output and message in res.output, res.output


def test_plan_sizes_a_video_as_the_engine_prepares_it(engine):
    from orin.memory.request_sizes import Request, request_tokens

    clip = load_video(synth_clip(5.0, 10, (64, 64), seed=7), VideoOptions(fps=2.0))
    prompt = engine.prepare(GenerationRequest(messages=_messages(clip)))
    for fps in (2.0, 1.0):
        req = Request(video_seconds=5.0, video_fps=fps, video_frame_pixels=64 * 64, speech=False)
        tokens = request_tokens(req, engine.sizes.dims, engine.profile)
        seen = engine.prepare(GenerationRequest(messages=_messages(
            load_video(synth_clip(5.0, 10, (64, 64), seed=7), VideoOptions(fps=fps)))))
        assert tokens["video"] == seen.n_video_tokens
        # the encoded soundtrack runs a codec frame or two past the video (AAC's padding): a token at most
        assert abs(tokens["audio"] - seen.n_audio_tokens) <= 1
    assert prompt.n_video_tokens == 5 * 4  # 10 frames at 2 fps: 5 grids of 2x2 merged tokens


def test_time_sliced_video_request_equals_all_resident(quantized_dir, engine, clip_video):
    from orin.runtime.engine import Engine, EngineConfig

    req = GenerationRequest(messages=_messages(clip_video, audio=True), max_new_tokens=6, max_audio_frames=20)
    text_a, frames_a, rep_a = _collect(engine, req)
    largest = max(engine.sizes.components[c].runtime_int4_bytes for c in engine.sizes.components)
    budget = int(largest * 1.6)
    small = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none", budget=budget))
    try:
        for _ in range(2):
            text_b, frames_b, rep_b = _collect(small, req)
            assert [s for s in rep_b.swaps if s.direction == "out"] and rep_b.peak_bytes <= budget
            assert (text_b, frames_b, rep_b.token_ids) == (text_a, frames_a, rep_a.token_ids)
            assert "video_encoded" in rep_b.timeline_s
    finally:
        small.close()


def test_long_prompt_path_gives_the_same_answer(engine, clip_video, quantized_dir):
    """A long video prompt's prefill (chunks through all layers, each attending to the cache the chunks before
    wrote, deepstack features added in their chunk; no prefill graph) answers as the one-pass prefill does."""
    req = GenerationRequest(messages=_messages(clip_video, audio=True), max_new_tokens=6, max_audio_frames=20)

    def prefill(eng):
        prompt = eng.prepare(req)
        inputs = dict(prompt.inputs)
        with torch.inference_mode():
            merged = eng.thinker.merge(inputs, prompt, *_features(eng, inputs, prompt))
            given = merged[0].clone()
            _, states, logits = eng.thinker.prefill(merged, prompt.length + 1, graph=False)
        return logits, states, bool(torch.equal(merged[0], given))

    def run(eng):
        seen: list[int] = []  # the rows of each block the talker's hidden projection sees
        hook = eng.model.talker.hidden_projection.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].shape[1]))
        try:
            return (_collect(eng, req), prefill(eng)), seen
        finally:
            hook.remove()

    # chunks end inside the video and its audio; a long prompt's projections on 48-row blocks
    long_engine = _engine_with(quantized_dir, engine.profile,
                               prefill={"long_prefill_tokens": 37, "long_projection_rows": 48})
    try:
        short, short_blocks = run(engine)
        long, seen = run(long_engine)
    finally:
        long_engine.close()
    assert set(short_blocks) == {engine.profile.prefill.projection_rows} and set(seen) == {48} and len(seen) > 1
    # the long prefill's first layer overwrote the embeddings (nothing reads them after): no whole-prompt copy
    assert short[1][2] and not long[1][2]
    short, long = (short[0], short[1][:2]), (long[0], long[1][:2])
    (text_s, frames_s, rep_s), (logits_s, states_s) = short
    (text_l, frames_l, rep_l), (logits_l, states_l) = long
    assert (text_l, frames_l, rep_l.token_ids) == (text_s, frames_s, rep_s.token_ids)
    torch.testing.assert_close(logits_l, logits_s, atol=1e-4, rtol=1e-4)
    for i in states_s:
        torch.testing.assert_close(states_l[i], states_s[i], atol=1e-4, rtol=1e-4)



@pytest.mark.parametrize("video", [True, False])
def test_long_prompt_on_the_whole_prompt_attention_gives_the_same_answer(engine, clip_video, quantized_dir,
                                                                         monkeypatch, video):
    """The long prefill as it runs on Hopper (each layer's attention whole, attention_block_long; here with SDPA's
    math kernel in cuDNN's place, on CPU) gives the one-pass prefill's logits and the talker's hidden states. The
    layers before every deepstack level is added (a video's first ones, the prefill's memory peak) take the
    leaner variants, the attention in chunks and MoE blocks of half the rows: all of the tiny thinker's two with a
    video, none without."""
    import orin.runtime.decode as decode
    from orin.inputs.media import synth_speechlike
    from orin.int4.experts import Int4Experts

    messages = _messages(clip_video, audio=True) if video else [
        {"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(3.0, seed=5)},
                                     {"type": "text", "text": "What did you hear?"}]}]
    req = GenerationRequest(messages=tuple(messages), max_new_tokens=6, max_audio_frames=20)

    def prefill(eng):
        prompt = eng.prepare(req)
        inputs = dict(prompt.inputs)
        with torch.inference_mode():
            merged = eng.thinker.merge(inputs, prompt, *_features(eng, inputs, prompt))
            return eng.thinker.prefill(merged, prompt.length + 1, graph=False)[1:]

    _collect(engine, req)  # every component resident, as a request leaves them
    states_s, logits_s = prefill(engine)
    # the long route from 37 tokens, its attention whole (cuDNN's path; SDPA's math kernel on the CPU)
    long_engine = _engine_with(quantized_dir, engine.profile, prefill={"long_prefill_tokens": 37},
                               capabilities={"cudnn_whole_prompt": True})
    whole, rows = [], []
    real_add_long = Int4Experts.add_long

    def add_long(self, *args, max_rows=None):
        rows.append(max_rows)
        return real_add_long(self, *args, max_rows=max_rows)

    real_long_attention = decode.attention_block_long

    def long_attention(*args):
        whole.append(len(rows))  # the layer it runs in: the MoE blocks recorded before it
        return real_long_attention(*args)

    # spies only: they record which layers take which variant and call the real functions
    monkeypatch.setattr(decode, "attention_block_long", long_attention)
    monkeypatch.setattr(Int4Experts, "add_long", add_long)
    try:
        _collect(long_engine, req)
        rows.clear()
        whole.clear()
        states_l, logits_l = prefill(long_engine)
    finally:
        long_engine.close()
    layers = len(engine.model.thinker.model.language_model.layers)
    block = engine.profile.prefill.long_moe_block_rows
    if video:
        assert rows == [block // 2] * layers and whole == []
    else:
        assert rows == [block] * layers and whole == list(range(layers))
    torch.testing.assert_close(logits_l, logits_s, atol=1e-4, rtol=1e-4)
    for i in states_s:
        torch.testing.assert_close(states_l[i], states_s[i], atol=1e-4, rtol=1e-4)


def test_a_long_prompt_not_held_drops_each_deepstack_level_once_added(engine, clip_video, quantized_dir,
                                                                     monkeypatch):
    """A long video prompt too large to hold for a next turn: each deepstack level is freed as soon as the layer
    after which it is added has run (nothing keeps it to the end of the prefill: at 2 fps the levels are 0.27
    GiB, and they set the video prefill's peak, BENCHMARKS.md run 51), and no next turn reads its rows."""
    import weakref

    from orin.int4.experts import Int4Experts

    req = GenerationRequest(messages=tuple(_messages(clip_video, audio=True)), max_new_tokens=6,
                            max_audio_frames=20)
    # the long route from 37 tokens, and nothing held for a next turn
    eng = _engine_with(quantized_dir, engine.profile, prefill={"long_prefill_tokens": 37},
                       capture={"held_max_bytes": 0})
    prompt = eng.prepare(req)
    inputs = dict(prompt.inputs)
    _collect(eng, req)
    alive_at_layer = []
    real_add_long = Int4Experts.add_long

    def add_long(self, *args, **kwargs):
        alive_at_layer.append([ref() is not None for ref in refs])
        return real_add_long(self, *args, **kwargs)

    monkeypatch.setattr(Int4Experts, "add_long", add_long)
    try:
        with torch.inference_mode():
            merged = eng.thinker.merge(inputs, prompt, *_features(eng, inputs, prompt))
            refs = [weakref.ref(level) for level in merged[3][1]]
            eng.thinker.prefill(merged, prompt.length + 1, graph=False)
        levels = len(refs)
        assert levels >= 2 and len(alive_at_layer) >= levels
        # at layer i's MLP, the levels added after layers 0..i-1 are gone, the rest still wait
        assert alive_at_layer[:levels] == [[j >= i for j in range(levels)] for i in range(levels)]
        assert all(ref() is None for ref in refs)
        # nothing held: the same prompt as a next turn reads no row from the cache
        _, _, report = eng.generate(replace(req, continues=True))
        assert not any(k.startswith("prefill_reused") for k in report.timeline_s)
    finally:
        eng.close()
