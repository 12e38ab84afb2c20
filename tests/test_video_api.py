"""Video in through the chat API (issue 16): `video_url` parts (data: URLs, file:// under --allow-dir) with the
official `openai` client against the real server around the shared engine (tiny quantized model, CPU); the
request-level `video_fps` and `use_audio_in_video` defaults; every refusal a 400 that names the part, after which
the server still answers.

Clips are tiny (64x96, 10 fps, seconds long) so the file stays fast on CPU. Prompt-token counts are the
observable: frames sampled and the soundtrack both add tokens.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import server_kit as kit

from orin.inputs.media import encode_wav
from orin.inputs.video import synth_clip

SIZE = (64, 96)


@pytest.fixture(scope="module")
def clip() -> bytes:
    """2 s with its soundtrack."""
    return synth_clip(2.0, 10, SIZE, audio=True, seed=1)


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    """4 s, silent: long enough that 1 fps and 2 fps sample different frame counts (a clip gives at least 4)."""
    return synth_clip(4.0, 10, SIZE, audio=False, seed=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory, clip, long_clip):
    """(allowed dir, a dir outside it), each holding the 2 s clip; the allowed one also the 4 s clip."""
    allowed, outside = tmp_path_factory.mktemp("videos"), tmp_path_factory.mktemp("elsewhere")
    for where in (allowed, outside):
        (where / "clip.mp4").write_bytes(clip)
    (allowed / "long.mp4").write_bytes(long_clip)
    return allowed, outside


@pytest.fixture(scope="module")
def strict_server(engine, quantized_dir, files):
    """A second server on the shared engine: file:// under the allowed dir, videos of at most 3 s."""
    srv = kit.start_server(engine, quantized_dir, allow_dir=str(files[0]), max_video_seconds=3.0)
    yield srv
    srv.stop()


def _data_url(raw: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def _messages(video_url: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": video_url},
                                         {"type": "text", "text": "What happens in this clip?"}]}]


def _ask(srv, engine, video_url: dict, **kw):
    return kit.client(srv).chat.completions.create(model=engine.model_name, messages=_messages(video_url),
                                                   max_tokens=3, **kw)


def _refused(srv, video_url: dict, **top) -> dict:
    """The error of a request the server must refuse with a 400; raw HTTP, to see `param`."""
    status, _, payload = kit.http_request(srv, "POST", "/v1/chat/completions",
                                          {"messages": _messages(video_url), "max_tokens": 2, **top})
    assert status == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


# --------------------------------------------------------------------------- answered


def test_a_video_with_its_soundtrack_is_answered(server, engine, clip):
    with_audio = _ask(server, engine, {"url": _data_url(clip)})
    assert with_audio.choices[0].message.content
    assert with_audio.usage.completion_tokens >= 1
    assert "video_encoded" in with_audio.model_extra["orin"]["timeline_s"]
    without = _ask(server, engine, {"url": _data_url(clip), "audio": False})
    assert without.usage.prompt_tokens < with_audio.usage.prompt_tokens
    # The request-level default does the same, and a part's own value wins over it.
    default_off = _ask(server, engine, {"url": _data_url(clip)}, extra_body={"use_audio_in_video": False})
    assert default_off.usage.prompt_tokens == without.usage.prompt_tokens
    part_wins = _ask(server, engine, {"url": _data_url(clip), "audio": True},
                     extra_body={"use_audio_in_video": False})
    assert part_wins.usage.prompt_tokens == with_audio.usage.prompt_tokens


def test_fps_per_part_and_per_request(server, engine, long_clip):
    url = _data_url(long_clip)
    one, two = (_ask(server, engine, {"url": url, "fps": fps}).usage.prompt_tokens for fps in (1, 2.0))
    assert one < two
    assert _ask(server, engine, {"url": url}).usage.prompt_tokens == two  # 2 fps when nothing says
    assert _ask(server, engine, {"url": url}, extra_body={"video_fps": 1}).usage.prompt_tokens == one
    assert _ask(server, engine, {"url": url, "fps": 2}, extra_body={"video_fps": 1}).usage.prompt_tokens == two


def test_file_urls_only_under_allow_dir(server, strict_server, engine, files):
    allowed, outside = files
    resp = _ask(strict_server, engine, {"url": (allowed / "clip.mp4").as_uri(), "audio": False})
    assert resp.usage.completion_tokens >= 1
    error = _refused(strict_server, {"url": (outside / "clip.mp4").as_uri()})
    assert "outside the allowed directory" in error["message"]
    assert error["param"] == "messages[0].content[0].video_url.url"
    error = _refused(server, {"url": (allowed / "clip.mp4").as_uri()})  # no --allow-dir: no files at all
    assert "file:// URLs are refused" in error["message"] and "send the video as a data: URL" in error["message"]


def test_a_video_over_max_video_seconds_is_refused(strict_server, files):
    error = _refused(strict_server, {"url": (files[0] / "long.mp4").as_uri()})
    assert "over the 3 s limit" in error["message"] and "--max-video-seconds" in error["message"]
    assert error["param"] == "messages[0].content[0].video_url"


# --------------------------------------------------------------------------- refused, and the server goes on


def _bad_media(clip: bytes) -> list[tuple[str, bytes, str]]:
    return [
        ("not a video", b"these bytes are plain text, not a video at all", "not a video file"),
        ("truncated", clip[: len(clip) // 2], "truncated"),
        ("audio only", encode_wav(np.zeros(16000, np.float32), sr=16000), "audio-only"),
    ]


def test_bad_videos_are_400_naming_the_part_and_the_server_stays_healthy(server, engine, clip):
    for name, raw, fragment in _bad_media(clip):
        error = _refused(server, {"url": _data_url(raw)})
        assert error["param"] == "messages[0].content[0].video_url", name
        assert error["message"].startswith("messages[0].content[0].video_url") and fragment in error["message"], name
    for video_url, top, param, fragment in (
        ({"url": _data_url(clip), "fps": 0}, {}, "messages[0].content[0].video_url.fps", "above 0 and at most 60"),
        # Python's json writes and reads `Infinity`, so a client may send one
        ({"url": _data_url(clip)}, {"video_fps": float("inf")}, "video_fps", "must be a number"),
        ({"url": _data_url(clip)}, {"use_audio_in_video": "yes"}, "use_audio_in_video", "true or false"),
        ({"url": "http://example.com/clip.mp4"}, {}, "messages[0].content[0].video_url", "never fetches"),
    ):
        error = _refused(server, video_url, **top)
        assert error["param"] == param and fragment in error["message"], error
    with pytest.raises(openai.BadRequestError, match="video_url.fps"):
        _ask(server, engine, {"url": _data_url(clip), "fps": 61})
    assert kit.http_request(server, "GET", "/health")[0] == 200
    ok = _ask(server, engine, {"url": _data_url(clip)})
    assert ok.choices[0].message.content and ok.usage.completion_tokens >= 1

