"""Calibration conversations: a user's JSONL files or directory, or the built-in synthetic set, turned into
processor inputs. All media is decoded up front, so a bad entry fails before the model is even loaded.

Format (``--calib PATH``):

- a ``.jsonl`` file: one conversation per line, ``{"messages": [{"role": "user", "content": [{"type": "text",
  "text": "..."}, {"type": "image", "path": "img.png"}, {"type": "audio", "path": "a.wav"}]},
  {"role": "assistant", "content": "..."}]}``; ``content`` may also be a plain string; roles are system, user
  and assistant; media paths are relative to the JSONL file; images and audio only in user turns;
- a directory: every ``*.jsonl`` in it (sorted by name), then every loose image (``.png .jpg .jpeg .webp``),
  audio (``.wav .flac .ogg .mp3``) and text (``.txt``) file, each becoming a one-turn conversation (a fixed
  instruction with the image or audio, or the text itself). Other files are ignored.

Images are downscaled so their longer side is at most MAX_IMAGE_SIDE pixels and audio is cut to
MAX_AUDIO_SECONDS: calibration needs representative activations, not full resolution.

One bad conversation never ends a run: one the processor cannot encode (a 600x2 banner image, a few
milliseconds of audio), or one the BF16 model fails on or gives an empty reply for in a pass, is skipped with a
warning naming it (``file:line``, the media path, or ``builtin:N``) and listed in report.json. A run fails only
when a pass is left with fewer than MIN_CALIBRATION calibration conversations for one of its stacks (fewer than
planned when fewer were planned) or with no held-out one; a skipped held-out conversation is replaced by a
calibration one with the same media when one can be spared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orin.audio_format import INPUT_SAMPLE_RATE
from orin.errors import InputError

from .skips import MIN_CALIBRATION, Skips, exception_text, too_few

IMAGE_EXT = (".png", ".jpg", ".jpeg", ".webp")
AUDIO_EXT = (".wav", ".flac", ".ogg", ".mp3")
TEXT_EXT = (".txt",)
MAX_IMAGE_SIDE = 448
MAX_AUDIO_SECONDS = 30.0
ROLES = ("system", "user", "assistant")

IMAGE_PROMPTS = ("Describe this image in detail.", "What objects and colours do you see here?",
                 "Write a short caption for this picture.")
AUDIO_PROMPTS = ("What do you hear in this recording?", "Transcribe this audio, then summarise it.",
                 "Describe the sound: pitch, rhythm, noise.")


@dataclass
class Conversation:
    """Messages in the chat template's shape, with the decoded media in order of appearance."""

    name: str
    messages: list[dict]
    images: list = field(default_factory=list)  # PIL images
    audios: list = field(default_factory=list)  # float32 mono 16 kHz arrays

    @property
    def modalities(self) -> frozenset[str]:
        return frozenset(["text"] + (["image"] if self.images else []) + (["audio"] if self.audios else []))


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
        for n, p in enumerate(f for f in files if f.suffix.lower() in IMAGE_EXT + AUDIO_EXT + TEXT_EXT):
            convs.append(_loose_file(p, n))
    if not convs:
        raise InputError(f"no calibration conversations in {root}: add *.jsonl files, images, audio or .txt files")
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
            elif kind in ("image", "audio"):
                if msg["role"] != "user":
                    raise InputError(f"{where}: message {i} part {j}: {kind} parts are only allowed in user turns")
                rel = part.get("path")
                if not isinstance(rel, str) or not rel:
                    raise InputError(f'{where}: message {i} part {j}: an {kind} part needs "path": "file"')
                media = base / rel
                if kind == "image":
                    conv.images.append(_image(media, where))
                else:
                    conv.audios.append(_audio(media, where))
                parts.append({"type": kind})
            else:
                raise InputError(f"{where}: message {i} part {j}: unknown part type {kind!r}; use text, image or audio")
        conv.messages.append({"role": msg["role"], "content": parts})
    if not any(m["role"] == "user" for m in conv.messages):
        raise InputError(f"{where}: the conversation has no user message")
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
    return Conversation(str(path), [_user([{"type": "audio"}], AUDIO_PROMPTS[n % len(AUDIO_PROMPTS)])],
                        audios=[_audio(path, str(path))])


def _user(media_parts: list[dict], text: str) -> dict:
    return {"role": "user", "content": media_parts + [{"type": "text", "text": text}]}


def _image(path: Path, where: str):
    from orin.media import load_image

    try:
        image = load_image(path)
    except InputError as exc:
        if where == str(path):
            raise
        raise InputError(f"{where}: {exc}") from exc
    return _downscale(image)


def _audio(path: Path, where: str) -> np.ndarray:
    from orin.media import load_audio

    try:
        audio = load_audio(path)
    except InputError as exc:
        if where == str(path):
            raise
        raise InputError(f"{where}: {exc}") from exc
    return audio[: int(MAX_AUDIO_SECONDS * INPUT_SAMPLE_RATE)]


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


def builtin_conversations(n: int, seed: int = 0) -> list[Conversation]:
    """A small deterministic multimodal set: text-only chats, images, tones, noise and speech-like audio, and
    image-plus-audio turns, cycling so every modality appears early. Real data calibrates better."""
    from orin.media import synth_image, synth_speechlike, synth_tone

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


def to_samples(processor, convs: list[Conversation], device, skips: Skips) -> list[Sample]:
    """The conversations the processor can encode, as model inputs (none held out yet: see hold_out); the others
    are skipped."""
    samples = []
    for i, conv in enumerate(convs):
        last_user = max(j for j, m in enumerate(conv.messages) if m["role"] == "user")
        try:
            full = _encode(processor, conv.messages, conv, add_generation_prompt=conv.messages[-1]["role"] == "user")
            prompt = _encode(processor, conv.messages[: last_user + 1], conv, add_generation_prompt=True)
        except InputError as exc:
            skips.add(conv.name, "encode", exc)
            continue
        samples.append(Sample(conv.name, i, _to(full, device), _to(prompt, device), conv.modalities,
                              int(full["input_ids"].shape[1])))
    return samples


def _encode(processor, messages: list[dict], conv: Conversation, add_generation_prompt: bool) -> dict:
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    try:
        return dict(processor(text=[text], images=conv.images or None, audio=conv.audios or None,
                              return_tensors="pt", padding=True))
    except (ValueError, RuntimeError, IndexError) as exc:
        raise InputError(f"the processor cannot encode it ({exception_text(exc)})") from exc


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
