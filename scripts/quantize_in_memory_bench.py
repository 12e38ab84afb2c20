"""Time the in-memory quantize path (issue 18's "today's path": the whole BF16 model loaded with transformers'
from_pretrained, as `orin-omni quantize` ran before it streamed) on a checkpoint, for BENCHMARKS.md beside the
streamed run on the same inputs. The path itself is the tests' oracle (tests/quantize_oracle.py); this only runs
it on CUDA and prints its wall time and peaks as JSON.

    python3 scripts/quantize_in_memory_bench.py MODEL_DIR [--samples N] [--speech-samples N] > in-memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--speech-samples", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    import torch
    from quantize_oracle import quantize_in_memory

    from orin.runtime.attention import without_cudnn_attention
    from quantize.pipeline import QuantConfig

    cfg = QuantConfig(model=args.model_dir, out="", samples=args.samples, speech_samples=args.speech_samples,
                      device=args.device, solver="own")
    start = time.perf_counter()
    with without_cudnn_attention():  # as the streamed run's passes (orin.runtime.attention)
        out = quantize_in_memory(args.model_dir, cfg)
    wall = time.perf_counter() - start
    cuda = torch.device(args.device).type == "cuda"
    print(json.dumps({
        "path": "in-memory (tests/quantize_oracle.py: from_pretrained, the whole BF16 model on the device)",
        "model_dir": args.model_dir, "samples": args.samples, "speech_samples": args.speech_samples,
        "wall_s": round(wall, 1),
        "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "host_rss_peak_bytes": _vm_hwm(),
        "segments": {name: {"tensors": len(seg["tensors"]), "metrics": seg["metrics"]} for name, seg in out.items()},
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
