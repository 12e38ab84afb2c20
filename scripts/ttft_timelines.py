"""Where the time to first token goes, request after request: the benchmark's standard request (full, with speech)
and its short form (2 tokens, no speech) through one engine per torch.compile setting, each request's timeline
printed and written to $OUT/probe.json. Run on the lent GPU like scripts/bench_gpu.sh (transformers 5.23 from .whl/):
    python3 scripts/ttft_timelines.py
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from devtools.bench_config import BenchConfig, bench_request, make_inputs
from devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint
from orin.runtime.engine import Engine, EngineConfig

out = os.environ.get("OUT", "/tmp")
ck = "/tmp/probe/ckpt"
if not os.path.exists(ck):
    write_synthetic_checkpoint(SyntheticConfig(config="tests/data/qwen3-omni-30b-a3b-instruct.config.json", out=ck, device="cuda", seed=0))
cfg = BenchConfig(config="tests/data/qwen3-omni-30b-a3b-instruct.config.json", synthetic=True, workdir="/tmp/probe",
                  audio_seconds=30, text_tokens=256, audio_frames=100)
inputs = make_inputs(cfg)
res = {}
for compile in (False, True):
    eng = Engine(EngineConfig(model_dir=ck, device="cuda", power_backend="none", verify_checksums=False, compile=compile))
    rows = []
    for kind in ["warm", "full", "short", "short", "short", "full", "short", "short"]:
        req = bench_request(cfg, inputs) if kind in ("warm", "full") else bench_request(cfg, inputs, max_new_tokens=2, speech=False)
        _, _, rep = eng.generate(req)
        rows.append({"kind": kind, "ttft": rep.ttft_s, "timeline": {k: round(v, 4) for k, v in rep.timeline_s.items()}})
        print(compile, kind, round(rep.ttft_s, 4), rows[-1]["timeline"], flush=True)
    res[str(compile)] = rows
    eng.close()
json.dump(res, open(os.path.join(out, "probe.json"), "w"), indent=1)
