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

from devtools.bench_storage import storage_bandwidth  # noqa: E402
from devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint  # noqa: E402
from orin.checkpoint.reader import Checkpoint  # noqa: E402
from orin.memory.loader import Loader  # noqa: E402
from orin.memory.packed_cache import PackedCache  # noqa: E402

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
# on CUDA, weights in their arenas (orin.memory.arena); PROFILE_BUDGET=0 profiles the all-resident loader
budget = int(os.environ.get("PROFILE_BUDGET", str(1 << 40))) or None
loader = Loader(ckpt, dev, torch.bfloat16, budget,
                packed=PackedCache.open(ck + "/packed", ckpt, dev, torch.bfloat16))
say("weights in arenas" if loader.mapped_bytes() is not None else "weights in the allocator")
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


def phases(piece: str, reps: int = 3) -> dict:
    """Wall seconds inside each step of the loading thread's path, per load of `piece` (the steps nest: a read
    holds its settle; a packed load holds its reads), beside the load's own seconds."""
    import orin.int4.experts as i4e
    import orin.int4.linear as i4
    import orin.memory.arena as wa
    import orin.memory.block_reader as br
    import orin.memory.loader as ld
    import orin.memory.packed_cache as pc
    import orin.memory.unit_reader as ur
    import orin.memory.vmm_driver as vd

    spent: dict = {}
    patched = []

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if threading.current_thread() is threading.main_thread():
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, wrapper)
        patched.append((owner, name, fn))

    for owner, name in ((pc.PackedCache, "find"), (br.BlockReader, "__init__"), (br.BlockReader, "read"),
                        (br.BlockReader, "_read_host"), (br.BlockReader, "_read_streamed"), (br._Lane, "settle"),
                        (br._Lane, "take"), (br._Lane, "new_block"), (br._Lane, "copy"), (vd.CudaVmm, "map"),
                        (ur.UnitReader, "_load_packed"), (ld.Loader, "_load_units"), (ur.UnitReader, "_keep_module"),
                        (ld.Loader, "_cap"), (ld.Loader, "_trim"), (wa.UnitArena, "begin"),
                        (i4.Int4Linear, "load_packed_"), (i4e.Int4Experts, "load_packed_"), (br, "_cut")):
        timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
    out = []
    try:
        for _ in range(reps):
            evict(piece)
            spent.clear()
            t = time.perf_counter()
            loader.ensure(comp(piece))
            sync()
            dt = time.perf_counter() - t
            out.append({"s": dt, **{k: round(v, 4) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}})
            say("phases", piece, round(dt, 4), out[-1])
    finally:
        for owner, name, fn in patched:
            setattr(owner, name, fn)
    return out


if DEVICE == "cuda":
    res["phases"] = {piece: phases(piece) for piece in ("talker_all", "thinker_4", "code2wav")}


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
                     "mapped": loader.mapped_bytes() or 0,
                     "resident": loader.resident_bytes()}
    say("memory", res["memory"])
json.dump(res, open(os.path.join(out, "profile_loader.json"), "w"), indent=1)
open(os.path.join(out, "profile_loader.txt"), "w").write(text.getvalue())
loader.close()
