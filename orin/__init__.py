"""orin-omni: Qwen3-Omni-30B-A3B on a Jetson AGX Orin as a service (device side)."""

__version__ = "0.1.0"
