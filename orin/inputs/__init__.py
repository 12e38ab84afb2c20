"""orin-omni's own input processing for Qwen3-Omni, from the checkpoint's files and without transformers:
chat template (jinja2), tokenizer (`tokenizers`), Whisper log-mel features and image patches (torch, PIL),
placeholder expansion, tied together by `Processor.from_dir(model_dir)`."""

from .processor import Processor

__all__ = ["Processor"]
