"""M-RoPE positions of one prompt, for the thinker and the talker: position ids [3, 1, T] (time, height, width)
and the rope delta decoding continues from (position of generated token n = prompt length + n + delta).

The same positions as transformers 5.23's Qwen3-Omni `get_rope_index` (through the thinker's and the talker's
`compute_3d_position_ids`), for a single unpadded sequence. Why the shape logic is what it is:
- Text advances all three axes together by one per token.
- A media segment is its start token(s), its placeholder tokens, its end token(s). Start and end tokens are text.
- Image: the placeholder tokens are the merged patch grid (t, h/m, w/m), frame-major then row-major (m the spatial
  merge size); each token takes (t * position_id_per_seconds, row, column) plus the segment's start position.
- Video: the same grid, with t scaled by the seconds per grid: t * seconds_per_grid * position_id_per_seconds.
- Audio: one position per audio token on all three axes (the encoder emits ~13 tokens a second); the token count
  comes from the Whisper feature length through the audio encoder's convolutions (`audio_token_count`).
- Video with its audio (<vision_start><audio_start> ... <audio_end><vision_end>): the video and the audio start at
  the same position and their tokens are merged by time, a video token going first on a tie; both start and end
  tokens are two wide.
- The position after a segment is one past the largest value of the last piece HF appended: the whole grid for an
  image or video, but for a video with audio only the piece left after the shorter stream ran out.
- The delta is the largest position + 1 - T.
Positions are float32 like HF's: a video's seconds per grid can make them fractional. As in HF, when no image or
video grid is given the positions are 0..T-1 and the delta 0 (audio alone lays out exactly so). Segments are found
by their start tokens; grids and audio lengths are consumed in order of appearance, as HF does (extra ones are
ignored: the talker sees only the user turns). The layout of a prompt (its segments) is computed once and cached:
the host work is proportional to the number of segments, the per-token work is vectorised tensor code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ..audio_format import audio_token_count
from ..errors import InputError, ModelError

if TYPE_CHECKING:
    import torch

# Qwen3-Omni config classes' defaults for keys a config.json may leave out (None: HF has no default either).
_THINKER_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656, "audio_token_id": 151646,
                     "vision_start_token_id": None, "audio_start_token_id": 151647, "position_id_per_seconds": 25}
_TALKER_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656, "audio_token_id": 151646,
                    "vision_start_token_id": 151652, "audio_start_token_id": 151669, "position_id_per_seconds": 25,
                    "spatial_merge_size": None}

IMAGE, VIDEO, AUDIO, VIDEO_AUDIO = "image", "video", "audio", "video+audio"


@dataclass(frozen=True)
class MRopeSpec:
    """The config values the positions depend on (one set for the thinker, one for the talker)."""

    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    position_id_per_seconds: int | float
    spatial_merge_size: int
    n_window: int  # the audio encoder's window; its token count per feature length depends on it


def _read(part: dict, defaults: dict, name: str, key: str):
    value = part.get(key, defaults.get(key))
    if value is None:
        raise ModelError(f"config.json {name}.{key} is missing; copy the checkpoint's own config.json")
    return value


def _spec(part: dict, defaults: dict, name: str, spatial_merge_size: int, n_window: int) -> MRopeSpec:
    keys = ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id", "audio_start_token_id")
    return MRopeSpec(*(int(_read(part, defaults, name, k)) for k in keys),
                     position_id_per_seconds=_read(part, defaults, name, "position_id_per_seconds"),
                     spatial_merge_size=int(spatial_merge_size), n_window=int(n_window))


def _part(config: dict, name: str) -> dict:
    part = config.get(name)
    if not isinstance(part, dict):
        raise ModelError(f"config.json has no {name}; give the full Qwen3-Omni checkpoint's config.json")
    return part


def _n_window(config: dict) -> int:
    return int((_part(config, "thinker_config").get("audio_config") or {}).get("n_window", 50))


def thinker_spec(config: dict) -> MRopeSpec:
    """The thinker's values, from the checkpoint's config.json (a dict)."""
    th = _part(config, "thinker_config")
    merge = (th.get("vision_config") or {}).get("spatial_merge_size", 2)
    return _spec(th, _THINKER_DEFAULTS, "thinker_config", merge, _n_window(config))


def talker_spec(config: dict) -> MRopeSpec:
    """The talker's values: its own token ids and merge size, the thinker's audio window (config.json's talker
    has none; orin.model.config_file.fix_config gives HF's talker the thinker's, as here)."""
    tk = _part(config, "talker_config")
    merge = _read(tk, _TALKER_DEFAULTS, "talker_config", "spatial_merge_size")
    return _spec(tk, _TALKER_DEFAULTS, "talker_config", merge, _n_window(config))


def _host_list(value) -> list:
    if value is None:
        return []
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _layout(ids: torch.Tensor, spec: MRopeSpec, image_grid_thw, video_grid_thw, audio_lengths,
            video_second_per_grid) -> tuple:
    """The prompt's media segments in order: (kind, start index, t, h, w, seconds per grid, audio tokens)."""
    import torch

    vs, a_s = spec.vision_start_token_id, spec.audio_start_token_id
    edge = ids.new_full((1,), -1)
    nxt, prev = torch.cat([ids[1:], edge]), torch.cat([edge, ids[:-1]])
    starts = torch.nonzero((ids == vs) | ((ids == a_s) & (prev != vs))).flatten()
    heads = torch.stack([starts, ids[starts], nxt[starts]]).tolist() if starts.numel() else [[], [], []]
    images, videos = _host_list(image_grid_thw), _host_list(video_grid_thw)
    audios = _host_list(audio_lengths)
    seconds = torch.as_tensor(video_second_per_grid if video_second_per_grid is not None else [],
                              dtype=torch.float32).reshape(-1).tolist()  # HF uses them as float32
    segments, counts = [], {IMAGE: 0, VIDEO: 0, AUDIO: 0}
    for start, head, follower in zip(*heads, strict=True):
        if head == a_s:
            kind = AUDIO
        elif follower in (spec.image_token_id, spec.video_token_id, a_s):
            kind = {spec.image_token_id: IMAGE, spec.video_token_id: VIDEO, a_s: VIDEO_AUDIO}[follower]
        else:
            raise InputError(f"token {start} of the prompt starts a vision segment with no image or video after it; "
                             "remove <|vision_start|> from the text")
        t = h = w = n_audio = 0
        spg = 0.0
        if kind == IMAGE:
            if counts[IMAGE] >= len(images):
                raise InputError(f"the prompt has more images than the {len(images)} image grids given")
            t, h, w = images[counts[IMAGE]]
        if kind in (VIDEO, VIDEO_AUDIO):
            if counts[VIDEO] >= min(len(videos), len(seconds)):
                raise InputError(f"the prompt has more videos than the {len(videos)} video grids and "
                                 f"{len(seconds)} seconds per grid given")
            (t, h, w), spg = videos[counts[VIDEO]], seconds[counts[VIDEO]]
        if kind in (AUDIO, VIDEO_AUDIO):
            if counts[AUDIO] >= len(audios):
                raise InputError(f"the prompt has more audio segments than the {len(audios)} audio lengths given")
            n_audio = audio_token_count(int(audios[counts[AUDIO]]), spec.n_window)
        for name in {IMAGE: (IMAGE,), VIDEO: (VIDEO,), AUDIO: (AUDIO,), VIDEO_AUDIO: (VIDEO, AUDIO)}[kind]:
            counts[name] += 1
        segments.append((kind, start, int(t), int(h), int(w), spg, n_audio))
    return tuple(segments)


def _line(n: int, start: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.arange(n, dtype=torch.float32).view(1, -1).expand(3, -1) + start


def _grid(start: torch.Tensor, t_index: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    import torch

    lh, lw = h // merge, w // merge
    rows = torch.arange(lh).view(1, -1, 1).expand(len(t_index), -1, lw).flatten().float()
    cols = torch.arange(lw).view(1, 1, -1).expand(len(t_index), lh, -1).flatten().float()
    times = t_index.view(-1, 1).expand(-1, lh * lw).flatten().float()
    return torch.stack([times, rows, cols]) + start


def _merge_by_time(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, int]:
    """HF's token-by-token merge of two time-sorted streams (video first on ties) as one scatter: a video token
    comes after every audio token of smaller time, an audio token after every video token of equal or smaller
    time. Also where the piece HF appends last (the rest of the longer-running stream) begins."""
    import torch

    v, a = video[0].contiguous(), audio[0].contiguous()
    nv, na = v.numel(), a.numel()
    at_v = torch.arange(nv) + torch.searchsorted(a, v, right=False)
    at_a = torch.arange(na) + torch.searchsorted(v, a, right=True)
    merged = video.new_empty((3, nv + na))
    merged[:, at_v], merged[:, at_a] = video, audio
    if nv + na == 0:
        return merged, 0
    is_video = torch.zeros(nv + na, dtype=torch.bool)
    is_video[at_v] = True
    switches = torch.nonzero(is_video != is_video[-1]).flatten()
    return merged, int(switches[-1]) + 1 if switches.numel() else 0


@lru_cache(maxsize=64)
def _positions(length: int, segments: tuple, spec: MRopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    pieces: list[torch.Tensor] = []

    def after_last() -> torch.Tensor:
        return pieces[-1].max() + 1 if pieces else torch.zeros((), dtype=torch.float32)

    cursor, merge, pps = 0, spec.spatial_merge_size, spec.position_id_per_seconds
    for kind, start, t, h, w, spg, n_audio in segments:
        st = after_last()
        if start < cursor:
            raise InputError(f"media segment at token {start} overlaps the one before it (which ends at token "
                             f"{cursor}); the prompt's placeholders do not match its grids or audio lengths")
        if start > cursor:
            pieces.append(_line(start - cursor, st))
            st = st + (start - cursor)
        edge = 2 if kind == VIDEO_AUDIO else 1
        pieces.append(_line(edge, st))
        st = st + edge
        body = n_audio
        if kind == IMAGE:
            pieces.append(_grid(st, (torch.arange(t) * 1 * pps).float(), h, w, merge))
        elif kind in (VIDEO, VIDEO_AUDIO):
            t_index = (torch.arange(t) * torch.tensor(spg, dtype=torch.float32) * pps).float()
            video = _grid(st, t_index, h, w, merge)
            if kind == VIDEO:
                pieces.append(video)
                body = 0
            else:
                merged, tail = _merge_by_time(video, _line(n_audio, st))
                pieces.extend(p for p in (merged[:, :tail], merged[:, tail:]) if p.shape[1])
        else:
            pieces.append(_line(n_audio, st))
        if kind != AUDIO:
            body += t * h * w // merge ** 2
        cursor = start + edge + body + edge
        pieces.append(_line(edge, after_last()))
    if cursor > length:
        raise InputError(f"the prompt's media segments need {cursor} tokens but it has {length}; its placeholders "
                         "do not match its grids or audio lengths")
    if cursor < length:
        pieces.append(_line(length - cursor, after_last()))
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0))
    delta = (positions.max() + 1 - length) if length else torch.zeros(())
    return positions, delta


def _check_counts(ids: torch.Tensor, spec: MRopeSpec, segments: tuple) -> None:
    """Every placeholder token belongs to a segment: else positions would land on the wrong tokens."""
    import torch

    want = {spec.image_token_id: 0, spec.video_token_id: 0, spec.audio_token_id: 0}
    for kind, _, t, h, w, _, n_audio in segments:
        if kind != AUDIO:
            want[spec.image_token_id if kind == IMAGE else spec.video_token_id] += t * h * w // spec.spatial_merge_size ** 2
        want[spec.audio_token_id] += n_audio
    have = torch.stack([(ids == tok).sum() for tok in want]).tolist()
    for (tok, n), got in zip(want.items(), have, strict=True):
        if n != got:
            raise InputError(f"the prompt has {got} placeholder tokens {tok} but its grids and audio lengths "
                             f"account for {n}; prepare the prompt and its media with the same processor")


def mrope_positions(input_ids, spec: MRopeSpec, *, image_grid_thw=None, video_grid_thw=None, audio_lengths=None,
                    video_second_per_grid=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [3, 1, T] float32, rope delta [1, 1] float32) of one sequence of token ids ([T] or [1, T]).
    image_grid_thw / video_grid_thw: [n, 3] patch grids (before the spatial merge), in order of appearance;
    audio_lengths: each audio's Whisper feature length (frames, the feature attention mask's sum), including the
    audio of videos with audio; video_second_per_grid: seconds per temporal grid of each video. Returned on
    `device` (default: the ids' device); freshly allocated, so the caller may change them."""
    import torch

    ids = torch.as_tensor(input_ids).long()
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise InputError(f"M-RoPE positions take one sequence of token ids, not shape {tuple(ids.shape)}")
    ids = ids.reshape(-1)
    device = ids.device if device is None else device
    if image_grid_thw is None and video_grid_thw is None:
        segments: tuple = ()
    else:
        segments = _layout(ids, spec, image_grid_thw, video_grid_thw, audio_lengths, video_second_per_grid)
        _check_counts(ids, spec, segments)
    positions, delta = _positions(int(ids.numel()), segments, spec)
    return (positions.view(3, 1, -1).to(device, copy=True), delta.reshape(1, 1).to(device, copy=True))


__all__ = ["MRopeSpec", "mrope_positions", "talker_spec", "thinker_spec"]
