"""What a developer runs, not the device: the benchmark, the synthetic checkpoints, the tiny model, the demo. Not in
the wheel: run from a checkout (the CLI's tiny-model, synthetic-bf16 and bench commands find it there)."""
