"""Write the synthetic INT4 checkpoint once for both trees, and its packed copies, with the BEFORE tree's code
(run from .base: its orin.devtools API is frozen at 272f6af).

  python3 prep.py CKPT_DIR [--config CONFIG] [--device cuda] [--pack-only] [--packed-cache DIR]

1. (unless --pack-only) orin.devtools.synthetic.write_synthetic_checkpoint, exactly as `bench --synthetic` does
   (seed 0, force), then os.sync() as the bench does.
2. An all-resident engine (compile off, no power meter) loads every component once with the packed cache, so the
   INT4 units' packed copies are written now, not during the first measured process (whose load would then take
   ~45 s and leave ~21 GB of dirty pages to write back under its measurements), then os.sync().
Prints one line per step with its seconds. Exit status 0 only if both steps finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--config", default="tests/data/qwen3-omni-30b-a3b-instruct.config.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--pack-only", action="store_true")
    ap.add_argument("--packed-cache", default="auto")
    args = ap.parse_args()

    from orin.devtools.bench_config import BenchConfig, free
    from orin.devtools.bench_engine import _load_all, open_engine

    t0 = time.perf_counter()
    if not args.pack_only:
        from orin.devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint

        write_synthetic_checkpoint(SyntheticConfig(config=args.config, out=args.ckpt, device=args.device, seed=0,
                                                   force=True), log=lambda m: print(f"[prep] {m}", flush=True))
        t1 = time.perf_counter()
        os.sync()
        print(f"[prep] synthetic checkpoint written in {t1 - t0:.1f} s, synced in {time.perf_counter() - t1:.1f} s",
              flush=True)
    # synthetic=True: the engine skips re-hashing the checkpoint it was just handed (as bench --synthetic does)
    cfg = BenchConfig(config=args.config, synthetic=True, device=args.device, power_backend="none",
                      packed_cache=args.packed_cache)
    t2 = time.perf_counter()
    engine = open_engine(cfg, args.ckpt, None, False)
    try:
        loaded = _load_all(engine)
    finally:
        engine.close()
        del engine
        free(cfg.device)
    t3 = time.perf_counter()
    os.sync()
    print(f"[prep] packed copies: {loaded['packed_written']} written, {loaded['packed_units']} read, load "
          f"{loaded['load_s']:.1f} s, engine {t3 - t2:.1f} s, sync {time.perf_counter() - t3:.1f} s; "
          f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
