"""`make demo`: the whole product on the tiny model, each step the command a user would type.

tiny model -> plan -> quantize -> install-service (staged under build/) -> serve in the background ->
smoke against it over HTTP -> stop the server. Prints each command before running it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _cli() -> list[str]:
    return [sys.executable, "-m", "orin.cli"]


def _run(args: list[str], **kw) -> None:
    print(f"\n$ orin-omni {shlex.join(args)}", flush=True)
    subprocess.run(_cli() + args, check=True, **kw)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server at {url} was not healthy after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default="build/demo")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    tiny, quant, root = work / "tiny-model", work / "tiny-int4", work / "root"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    _run(["tiny-model", str(tiny), "--seed", "0", "--force"])
    _run(["plan", str(tiny), "--budget", "64MiB", "--audio-seconds", "30"])
    _run(["quantize", str(tiny), "--out", str(quant), "--device", "cpu", "--samples", "24",
          "--reply-tokens", "6", "--speech-frames", "8"])
    _run(["install-service", "--model-dir", str(quant.resolve()), "--root", str(root.resolve()), "--port",
          str(args.port), "--budget", "64MiB", "--force"])
    _run(["generate", str(quant), "--text", "Describe the sound.", "--max-new-tokens", "8",
          "--max-audio-frames", "16", "--out-wav", str(work / "answer.wav"), "--device", "cpu"])

    url = f"http://127.0.0.1:{args.port}"
    serve = ["serve", "--model-dir", str(quant), "--host", "127.0.0.1", "--port", str(args.port), "--budget", "64MiB",
             "--max-speech-seconds", "4"]  # the random tiny talker never stops speaking by itself
    print(f"\n$ orin-omni {shlex.join(serve)} &", flush=True)
    proc = subprocess.Popen(_cli() + serve)
    try:
        _wait_healthy(url, proc)
        _run(["smoke", "--url", url])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"\nserver stopped (exit code {proc.returncode})")
    print(f"\ndemo finished: artifacts in {work}/ (unit files under {root}/etc/systemd/system)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
