"""Calibration conversations: a user's JSONL files or directory, or the built-in synthetic set, turned into
processor inputs. All media is decoded up front, so a bad entry fails before the model is even loaded.

Format (``--calib PATH``):

- a ``.jsonl`` file: one conversation per line, ``{"messages": [{"role": "user", "content": [{"type": "text",
  "text": "..."}, {"type": "image", "path": "img.png"}, {"type": "audio", "path": "a.wav"}, {"type": "video",
  "path": "clip.mp4"}]}, {"role": "assistant", "content": "..."}]}``; ``content`` may also be a plain string;
  roles are system, user and assistant; media paths are relative to the JSONL file; images, audio and video only
  in user turns. A video part may also set ``"fps"`` (frames sampled per second, default 2, as served) and
  ``"audio"`` (false: leave its soundtrack out; default true: the model hears it, audio in video);
- a directory: every ``*.jsonl`` in it (sorted by name), then every loose image (``.png .jpg .jpeg .webp``),
  audio (``.wav .flac .ogg .mp3``), video (``.mp4 .mkv .webm .mov``) and text (``.txt``) file, each becoming a
  one-turn conversation (a fixed instruction with the image, audio or video, or the text itself). Other files are
  ignored.

Images are downscaled so their longer side is at most MAX_IMAGE_SIDE pixels, audio is cut to MAX_AUDIO_SECONDS
and videos to their first MAX_VIDEO_SECONDS (frames sized as the server sizes them, orin.inputs.video): calibration
needs representative activations, not full length. A video calibrates the vision encoder on temporal grids of
two frames each and, with its soundtrack, the audio encoder and the thinker on audio tokens interleaved with the
video's (transformers' ``use_audio_in_video=True``); the videos of one conversation either all keep their
soundtracks or none does. Video conversations are encoded by orin.inputs' processor (transformers' needs
torchvision for video), the others by transformers' (quantize.hf_processor).

One bad conversation never ends a run: one the processor cannot encode (a 600x2 banner image, a few
milliseconds of audio), or one the BF16 model fails on or gives an empty reply for in a pass, is skipped with a
warning naming it (``file:line``, the media path, or ``builtin:N``) and listed in report.json. A run fails only
when a pass is left with fewer than MIN_CALIBRATION calibration conversations for one of its stacks (fewer than
planned when fewer were planned) or with no held-out one; a skipped held-out conversation is replaced by a
calibration one with the same media when one can be spared.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orin.audio_format import INPUT_SAMPLE_RATE
from orin.errors import InputError

from .skips import MIN_CALIBRATION, Skips, exception_text, too_few

IMAGE_EXT = (".png", ".jpg", ".jpeg", ".webp")
AUDIO_EXT = (".wav", ".flac", ".ogg", ".mp3")
VIDEO_EXT = (".mp4", ".mkv", ".webm", ".mov")
TEXT_EXT = (".txt",)
MAX_IMAGE_SIDE = 448
MAX_AUDIO_SECONDS = 30.0
MAX_VIDEO_SECONDS = 30.0
VIDEO_KEYS = ("type", "path", "fps", "audio")
MODALITIES = ("text", "image", "audio", "video")
ROLES = ("system", "user", "assistant")

IMAGE_PROMPTS = ("Describe this image in detail.", "What objects and colours do you see here?",
                 "Write a short caption for this picture.")
AUDIO_PROMPTS = ("What do you hear in this recording?", "Transcribe this audio, then summarise it.",
                 "Describe the sound: pitch, rhythm, noise.")
VIDEO_PROMPTS = ("Describe what happens in this video.", "What do you see and hear in this clip?",
                 "Summarise the clip: the motion, the colours and the sound.")


@dataclass
class Conversation:
    """Messages in the chat template's shape, with the decoded media in order of appearance."""

    name: str
    messages: list[dict]
    images: list = field(default_factory=list)  # PIL images
    audios: list = field(default_factory=list)  # float32 mono 16 kHz arrays
    videos: list = field(default_factory=list)  # orin.inputs.video.Video clips (their soundtracks, if any, heard too)

    @property
    def modalities(self) -> frozenset[str]:
        """What the conversation feeds: "video" calibrates the vision encoder as "image" does, and a video's
        soundtrack counts as "audio" (it feeds the audio encoder)."""
        heard = bool(self.audios) or any(v.audio is not None for v in self.videos)
        return frozenset(["text"] + (["image"] if self.images else []) + (["audio"] if heard else [])
                         + (["video"] if self.videos else []))

    @property
    def audio_in_video(self) -> bool:
        """Whether its videos are heard with their soundtracks (transformers' `use_audio_in_video`)."""
        return any(v.audio is not None for v in self.videos)


@dataclass(eq=False)  # compared by identity: the inputs are tensors
class Sample:
    """One conversation as model inputs. `inputs` is the whole conversation (the thinker pass is teacher-forced
    over it); `prompt_inputs` stops after the last user turn with the generation prompt (the speech pass).
    `name` is the conversation's origin; `index` its place in the calibration set."""

    name: str
    index: int
    inputs: dict
    prompt_inputs: dict
    modalities: frozenset[str]
    tokens: int
    heldout: bool = False


# ---------------------------------------------------------------------- loading user data


def load_calibration(path: str | Path) -> list[Conversation]:
    """Conversations from a .jsonl file or a directory (see the module docstring); InputError names the file,
    the line and the problem."""
    root = Path(path)
    if not root.exists():
        raise InputError(f"calibration path {root} does not exist; give a .jsonl file or a directory")
    if root.is_file():
        if root.suffix.lower() != ".jsonl":
            raise InputError(f"calibration file {root} is not a .jsonl file; give a .jsonl file or a directory")
        convs = _load_jsonl(root)
    else:
        convs = []
        files = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
        for p in files:
            if p.suffix.lower() == ".jsonl":
                convs.extend(_load_jsonl(p))
        for n, p in enumerate(f for f in files if f.suffix.lower() in IMAGE_EXT + AUDIO_EXT + VIDEO_EXT + TEXT_EXT):
            convs.append(_loose_file(p, n))
    if not convs:
        raise InputError(f"no calibration conversations in {root}: add *.jsonl files, images, audio, videos or "
                         ".txt files")
    return convs


def _load_jsonl(path: Path) -> list[Conversation]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read calibration file ({exc})") from exc
    convs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        convs.append(_conversation(entry, where, path.parent))
    return convs


def _conversation(entry, where: str, base: Path) -> Conversation:
    messages = entry.get("messages") if isinstance(entry, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(f'{where}: expected {{"messages": [...]}} with at least one message')
    conv = Conversation(where, [])
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise InputError(f"{where}: message {i} needs a role of {', '.join(ROLES)}")
        content = msg.get("content")
        if isinstance(content, str):
            conv.messages.append({"role": msg["role"], "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise InputError(f"{where}: message {i} content must be a string or a non-empty list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InputError(f'{where}: message {i} part {j}: a text part needs "text": "..."')
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image", "audio", "video"):
                if msg["role"] != "user":
                    raise InputError(f"{where}: message {i} part {j}: {kind} parts are only allowed in user turns")
                rel = part.get("path")
                if not isinstance(rel, str) or not rel:
                    article = "a" if kind == "video" else "an"
                    raise InputError(f'{where}: message {i} part {j}: {article} {kind} part needs "path": "file"')
                media = base / rel
                if kind == "image":
                    conv.images.append(_image(media, where))
                elif kind == "audio":
                    conv.audios.append(_audio(media, where))
                else:
                    conv.videos.append(_video(media, f"{where}: message {i} part {j}", part))
                parts.append({"type": kind})
            else:
                raise InputError(f"{where}: message {i} part {j}: unknown part type {kind!r}; use text, image, audio "
                                 "or video")
        conv.messages.append({"role": msg["role"], "content": parts})
    if not any(m["role"] == "user" for m in conv.messages):
        raise InputError(f"{where}: the conversation has no user message")
    _check_soundtracks(conv, where)
    return conv


def _loose_file(path: Path, n: int) -> Conversation:
    suffix = path.suffix.lower()
    if suffix in TEXT_EXT:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: cannot read calibration text ({exc})") from exc
        if not text:
            raise InputError(f"{path}: calibration text file is empty")
        return Conversation(str(path), [{"role": "user", "content": text}])
    if suffix in IMAGE_EXT:
        return Conversation(str(path), [_user([{"type": "image"}], IMAGE_PROMPTS[n % len(IMAGE_PROMPTS)])],
                            images=[_image(path, str(path))])
    if suffix in VIDEO_EXT:
        return Conversation(str(path), [_user([{"type": "video"}], VIDEO_PROMPTS[n % len(VIDEO_PROMPTS)])],
                            videos=[_video(path, str(path), {})])
    return Conversation(str(path), [_user([{"type": "audio"}], AUDIO_PROMPTS[n % len(AUDIO_PROMPTS)])],
                        audios=[_audio(path, str(path))])


def _user(media_parts: list[dict], text: str) -> dict:
    return {"role": "user", "content": media_parts + [{"type": "text", "text": text}]}


def _image(path: Path, where: str):
    from orin.inputs.media import load_image

    try:
        image = load_image(path)
    except InputError as exc:
        if where == str(path):
            raise
        raise InputError(f"{where}: {exc}") from exc
    return _downscale(image)


def _audio(path: Path, where: str) -> np.ndarray:
    from orin.inputs.media import load_audio

    try:
        audio = load_audio(path)
    except InputError as exc:
        if where == str(path):
            raise
        raise InputError(f"{where}: {exc}") from exc
    return audio[: int(MAX_AUDIO_SECONDS * INPUT_SAMPLE_RATE)]


def _video(path: Path, where: str, part: dict):
    """The clip at `path` as the server samples it (orin.inputs.video.load_video), with the part's "fps" and "audio",
    cut to MAX_VIDEO_SECONDS. `where` names the part (file:line, message and part) or the loose file."""
    from orin.inputs.video import VideoOptions, load_video

    unknown = sorted(k for k in part if k not in VIDEO_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in a video part; a video part "
                         'takes "path", "fps" (frames sampled per second, e.g. 2) and "audio" (true or false)')
    fps = part.get("fps", VideoOptions.fps)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)):
        raise InputError(f'{where}: "fps" must be a number of frames sampled per second (e.g. 2), not {fps!r}')
    audio = part.get("audio", True)
    if not isinstance(audio, bool):
        raise InputError(f'{where}: "audio" must be true (hear the soundtrack) or false, not {audio!r}')
    prefix = "" if where == str(path) else f"{where}: "
    try:
        video = load_video(path, VideoOptions(fps=fps, audio=audio))
    except InputError as exc:
        raise InputError(f"{prefix}{exc}") from exc
    return _trim(video, MAX_VIDEO_SECONDS)


def _trim(video, seconds: float):
    """The clip's first `seconds` (an even count of frames, at least two) and its soundtrack's."""
    if video.duration <= seconds:
        return video
    keep = sum(t < seconds for t in video.timestamps)
    keep = max(2, keep - keep % 2)
    audio = None if video.audio is None else video.audio[: int(seconds * INPUT_SAMPLE_RATE)]
    return dataclasses.replace(video, frames=video.frames[:keep], timestamps=video.timestamps[:keep],
                               duration=seconds, audio=audio)


def _check_soundtracks(conv: Conversation, where: str) -> None:
    """transformers lays out audio in video for all of a prompt's videos or for none."""
    heard = [v.audio is not None for v in conv.videos]
    if any(heard) and not all(heard):
        raise InputError(f"{where}: some of its videos have a soundtrack and some have none (or \"audio\": false); "
                         "the model hears the soundtracks of all of a conversation's videos or of none: set "
                         '"audio": false on every video part of this line, or use clips that all have sound')


def _downscale(image):
    from PIL import Image

    side = max(image.size)
    if side <= MAX_IMAGE_SIDE:
        return image
    scale = MAX_IMAGE_SIDE / side
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                        Image.Resampling.BICUBIC)


# ---------------------------------------------------------------------- the built-in set

_TEXT = (
    ("Explain why the sky is blue in two sentences.",
     "Sunlight scatters off air molecules, and short blue wavelengths scatter the most. So blue light reaches "
     "our eyes from every direction of the sky."),
    ("Write a Python function that returns the n-th Fibonacci number.",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("What is 17 * 23? Show the steps.", "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391."),
    ("Traduis en français : the train leaves at seven in the morning.", "Le train part à sept heures du matin."),
    ("Give three tips for a good night's sleep.",
     "Keep a regular schedule, avoid screens an hour before bed, and keep the bedroom cool and dark."),
    ("Summarise the plot of Romeo and Juliet in one paragraph.",
     "Two young lovers from feuding families in Verona marry in secret; a chain of misunderstandings ends in "
     "both their deaths, which finally reconciles the families."),
    ("¿Cuál es la capital de Australia y por qué no es Sídney?",
     "Es Canberra: se construyó como compromiso entre Sídney y Melbourne."),
    ("List the planets of the solar system in order from the sun.",
     "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune."),
    ("用一句话解释什么是机器学习。", "机器学习是让计算机从数据中学习规律并据此做出预测的方法。"),
    ("Convert 72 degrees Fahrenheit to Celsius.", "(72 - 32) * 5 / 9 = 22.2 degrees Celsius."),
    ("Write a haiku about autumn rain.", "Cold rain on red leaves\nthe gutter hums a low song\nlamps come on early"),
    ("What does the HTTP status code 404 mean?", "The server could not find the requested resource."),
)
_IMAGE_KINDS = ("shapes", "gradient", "checker")
# The built-in clips: (seconds, (height, width)) in turn; 2 fps gives temporal grids of 2, 3 and 4.
_CLIPS = ((3.0, (96, 128)), (2.0, (64, 96)), (4.0, (128, 64)))
_CLIP_SOURCE_FPS = 4


def builtin_conversations(n: int, seed: int = 0) -> list[Conversation]:
    """A small deterministic multimodal set, in cycles of four: a text-only chat, an image, a tone, noise or
    speech-like audio, and an image-plus-audio turn, which every other cycle (from the second on: builtin:7, 15,
    ...) is a short synthetic video with its soundtrack instead, so every modality appears early. Real data
    calibrates better."""
    from orin.inputs.media import synth_image, synth_speechlike, synth_tone

    rng = np.random.default_rng(seed)
    convs = []
    for i in range(n):
        kind = i % 4
        name = f"builtin:{i}"
        if kind == 0:
            question, answer = _TEXT[(i // 4) % len(_TEXT)]
            convs.append(Conversation(name, [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]))
            continue
        if kind == 3 and (i // 4) % 2 == 1:
            seconds, size = _CLIPS[(i // 8) % len(_CLIPS)]
            convs.append(Conversation(name, [_user([{"type": "video"}], VIDEO_PROMPTS[(i // 8) % len(VIDEO_PROMPTS)])],
                                      videos=[_builtin_clip(seconds, size, seed * 1000 + i)]))
            continue
        conv = Conversation(name, [])
        parts: list[dict] = []
        if kind in (1, 3):
            size = (int(rng.choice([160, 224, 288])), int(rng.choice([160, 224])))
            conv.images.append(synth_image(size, seed=seed * 1000 + i, kind=_IMAGE_KINDS[i % 3]))
            parts.append({"type": "image"})
        if kind in (2, 3):
            seconds = float(rng.uniform(1.0, 3.0))
            if i % 3 == 0:
                audio = synth_speechlike(seconds, seed=seed * 1000 + i)
            else:
                freqs = tuple(float(f) for f in rng.uniform(150, 3000, int(rng.integers(1, 4))))
                audio = synth_tone(seconds, freqs=freqs, noise=float(rng.choice([0.0, 0.02, 0.1])), seed=i)
            conv.audios.append(audio)
            parts.append({"type": "audio"})
        prompts = IMAGE_PROMPTS if kind == 1 else AUDIO_PROMPTS if kind == 2 else \
            ("Does the sound match the picture? Explain.",)
        conv.messages.append(_user(parts, prompts[i % len(prompts)]))
        convs.append(conv)
    return convs


@functools.lru_cache(maxsize=64)
def _builtin_clip(seconds: float, size: tuple[int, int], seed: int):
    """A synthetic clip with its soundtrack (orin.inputs.video.synth_clip), decoded as the server decodes one: frames at
    2 fps, sides multiples of 32. Cached: the same set is often built more than once in a process."""
    from orin.inputs.video import VideoOptions, load_video, synth_clip

    data = synth_clip(seconds, _CLIP_SOURCE_FPS, size, audio=True, seed=seed)
    return load_video(data, VideoOptions(fps=2.0), name=f"the built-in clip {seed}")


# ---------------------------------------------------------------------- selection and model inputs


def split_heldout(convs: list[Conversation], holdout: int) -> set[int]:
    """Indices to hold out for the report, taken from the end: first conversations that bring a modality the
    held-out set lacks (so every encoder gets a held-out error), then any; never one whose removal would leave
    the calibration side without one of its modalities, unless nothing else can be held out."""
    chosen: list[int] = []

    def keeps(i: int) -> bool:
        left = [c for j, c in enumerate(convs) if j != i and j not in chosen]
        return all(any(m in c.modalities for c in left) for m in convs[i].modalities)

    missing = set().union(*(c.modalities for c in convs)) - {"text"}
    for i in reversed(range(len(convs))):
        if len(chosen) >= holdout or not missing:
            break
        if convs[i].modalities & missing and keeps(i):
            chosen.append(i)
            missing -= convs[i].modalities
    for i in reversed(range(len(convs))):
        if len(chosen) >= holdout:
            break
        if i not in chosen and keeps(i):
            chosen.append(i)
    if not chosen and convs:
        chosen.append(len(convs) - 1)
    return set(chosen)


def holdout_count(samples: int) -> int:
    """Held-out conversations for the report: an eighth, at least 1, at most 8."""
    return max(1, min(8, samples // 8))


def to_samples(processor, convs: list[Conversation], device, skips: Skips, video_processor=None) -> list[Sample]:
    """The conversations the processor can encode, as model inputs (none held out yet: see hold_out); the others
    are skipped. `processor` is transformers' (quantize.hf_processor), which has no video processor; conversations with
    videos go through `video_processor` (orin.inputs.Processor: the same tensors, videos included)."""
    if video_processor is None and any(c.videos for c in convs):
        raise ValueError("to_samples: conversations with videos need a video_processor (orin.inputs.Processor)")
    samples = []
    for i, conv in enumerate(convs):
        last_user = max(j for j, m in enumerate(conv.messages) if m["role"] == "user")
        proc = video_processor if conv.videos else processor
        try:
            full = _encode(proc, conv.messages, conv, add_generation_prompt=conv.messages[-1]["role"] == "user")
            prompt = _encode(proc, conv.messages[: last_user + 1], conv, add_generation_prompt=True)
        except InputError as exc:
            skips.add(conv.name, "encode", exc)
            continue
        samples.append(Sample(conv.name, i, _to(full, device), _to(prompt, device), conv.modalities,
                              int(full["input_ids"].shape[1])))
    return samples


def _encode(processor, messages: list[dict], conv: Conversation, add_generation_prompt: bool) -> dict:
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    media = {"videos": conv.videos} if conv.videos else {}  # transformers' processor here has no video processor
    try:
        inputs = dict(processor(text=[text], images=conv.images or None, audio=conv.audios or None,
                                return_tensors="pt", padding=True, **media))
    except (InputError, ValueError, RuntimeError, IndexError) as exc:
        raise InputError(f"the processor cannot encode it ({exception_text(exc)})") from exc
    if conv.audio_in_video:
        # the soundtracks' tokens are interleaved with the videos': the model's rope index must know (the
        # thinker's forward and generate() both take it)
        inputs["use_audio_in_video"] = True
    return inputs


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}


def hold_out(source: str, convs: list[Conversation], samples: list[Sample], skips: Skips) -> None:
    """Mark the held-out samples among those that could be encoded (split_heldout, holdout_count of them);
    TooFewConversations when the skipped ones leave too few to calibrate on."""
    planned = len(convs) - holdout_count(len(convs))
    usable = len(samples) - holdout_count(len(samples)) if len(samples) >= 2 else 0
    if usable < min(MIN_CALIBRATION, planned):
        raise too_few(source, "that the processor can encode", usable, min(MIN_CALIBRATION, planned), skips)
    for i in split_heldout(samples, holdout_count(len(samples))):
        samples[i].heldout = True
