"""Where a swap-in's time goes, component by component, at the real dimensions: the synthetic checkpoint loaded
once (writing the packed copies), then each swappable piece evicted and loaded again in the foreground, profiled
(cProfile, the loading thread's own calls), beside the same host's storage -> device bandwidth; then the same
loads in the background while the main thread keeps the GIL busy as a decode loop does, at two GIL switch
intervals. Run on the lent GPU like scripts/bench_gpu.sh:
    python3 scripts/profile_loader.py      # $OUT/profile_loader.json and .txt
"""
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from orin.checkpoint import Checkpoint  # noqa: E402
from orin.devtools.bench_storage import storage_bandwidth  # noqa: E402
from orin.devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint  # noqa: E402
from orin.loader import Loader  # noqa: E402
from orin.packed_cache import PackedCache  # noqa: E402

out = os.environ.get("OUT", "/tmp")
ck = os.environ.get("PROFILE_CKPT", "/tmp/probe/ckpt")
CONFIG = os.environ.get("PROFILE_CONFIG", "tests/data/qwen3-omni-30b-a3b-instruct.config.json")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
text = io.StringIO()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def say(*a):
    print(*a, flush=True)
    print(*a, file=text)


if not os.path.exists(ck):
    t = time.perf_counter()
    write_synthetic_checkpoint(SyntheticConfig(config=CONFIG, out=ck, device=DEVICE, seed=0))
    say("write", round(time.perf_counter() - t, 1))
dev = torch.device(DEVICE)
ckpt = Checkpoint.open(ck, verify=False)
# a budget (none fits under it: nothing is evicted but what the script evicts) makes the loader time-sliced:
# on CUDA, weights in their arenas (orin.weight_arena); PROFILE_BUDGET=0 profiles the all-resident loader
budget = int(os.environ.get("PROFILE_BUDGET", str(1 << 40))) or None
loader = Loader(ckpt, dev, torch.bfloat16, budget,
                packed=PackedCache.open(ck + "/packed", ckpt, dev, torch.bfloat16))
say("weights in arenas" if loader._arenas is not None else "weights in the allocator")
t = time.perf_counter()
for c in ("thinker_text", "audio_encoder", "vision_encoder", "talker", "code_predictor", "code2wav"):
    loader.ensure(c)
say("first load (packed copies written)", round(time.perf_counter() - t, 1))
res = {"storage": {}, "foreground": {}, "background": {}}
for seg in sorted(os.listdir(ck)):
    p = os.path.join(ck, seg, "model.safetensors")
    if os.path.exists(p):
        res["storage"][seg] = storage_bandwidth(p, dev)
        say("storage", seg, res["storage"][seg])

PIECES = {
    "audio_encoder": ["audio_encoder"],
    "code2wav": ["code2wav"],
    "code_predictor": ["code_predictor"],
    "vision_encoder": ["vision_encoder"],
    "talker_5": [u for u in loader.units("talker") if "/" in u][-5:],
    "talker_all": list(loader.units("talker")),
    "thinker_4": [u for u in loader.units("thinker_text") if "/" in u][-4:],
}


def evict(piece):
    names = PIECES[piece]
    loader.evict_units([u for u in loader.resident_units() if u in names])
    sync()


def comp(piece):
    return PIECES[piece][0].split("/")[0]


for piece in PIECES:
    for rep in range(3):
        evict(piece)
        prof = cProfile.Profile() if rep == 2 else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        loader.ensure(comp(piece))
        sync()
        if prof:
            prof.disable()
        dt = time.perf_counter() - t
        swap = [s for s in loader.take_swaps() if s.direction == "in"][-1]
        res["foreground"].setdefault(piece, []).append({"s": dt, "bytes": swap.bytes, "gb_s": swap.bytes / dt / 1e9,
                                                        "packed": swap.packed})
        say("fg", piece, rep, round(dt, 4), swap.bytes, round(swap.bytes / dt / 1e9, 2), "GB/s", "packed",
            swap.packed, "profiled" if prof else "")
        if prof:
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(18)
            st.sort_stats("cumulative").print_stats(25)
            say(s.getvalue()[:9000])


def busy(stop, launches):
    """The decode loop's shape: Python between launches, a sync per step."""
    x = torch.randn(64, 64, device=dev)
    while not stop.is_set():
        for _ in range(40):
            x = torch.tanh(x @ x) * 0.5
        sync()
        launches[0] += 80


for interval in (0.005, 0.0005):
    sys.setswitchinterval(interval)
    for piece in ("audio_encoder", "code2wav", "talker_5"):
        evict(piece)
        stop, launches = threading.Event(), [0]
        th = threading.Thread(target=busy, args=(stop, launches))
        th.start()
        time.sleep(0.05)
        t = time.perf_counter()
        loader.prefetch(comp(piece))
        loader.settle()
        dt = time.perf_counter() - t
        stop.set()
        th.join()
        swap = [s for s in loader.take_swaps() if s.direction == "in"][-1]
        res["background"].setdefault(str(interval), {})[piece] = {"s": dt, "bytes": swap.bytes,
                                                                  "gb_s": swap.bytes / dt / 1e9,
                                                                  "launches_per_s": launches[0] / dt}
        say("bg", interval, piece, round(dt, 4), round(swap.bytes / dt / 1e9, 2), "GB/s", "launches/s",
            round(launches[0] / dt))
sys.setswitchinterval(0.005)
if DEVICE == "cuda":
    res["memory"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                     "mapped": loader._arenas.mapped if loader._arenas is not None else 0,
                     "resident": loader.resident_bytes()}
    say("memory", res["memory"])
json.dump(res, open(os.path.join(out, "profile_loader.json"), "w"), indent=1)
open(os.path.join(out, "profile_loader.txt"), "w").write(text.getvalue())
loader.close()
