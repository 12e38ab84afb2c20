"""A quantize run's settings (`orin-omni quantize`'s options) and what they are recorded as: the manifest's
quantization entry, the GPTQ solver's name, where the calibration set came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from orin.checkpoint.targets import QuantSpec

from .memory import DEFAULT_MAX_GPU_MEMORY, DEFAULT_MAX_HOST_MEMORY
from .skips import BUILTIN_SOURCE

DEFAULT_SAMPLES = 128
DEFAULT_MIN_EXPERT_TOKENS = 64


@dataclass(frozen=True)
class QuantConfig:
    model: str
    out: str
    segments: tuple[str, ...] | None = None  # which segments to quantize (default: all of the split)
    split: str | None = None  # the segment split, e.g. "thinker=audio_encoder+thinker_text;talker_vision=..."
    bits: int = 4
    group_size: int = 128
    calib: str | None = None  # .jsonl file or directory; None = the built-in synthetic set
    samples: int = DEFAULT_SAMPLES
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    quantize_audio_encoder: bool = False
    quantize_code_predictor: bool = False
    quantize_code2wav: bool = False
    quantize_lm_head: bool = False
    min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS
    starved_experts: str = "all-tokens"  # or "rtn"
    damp: float = 0.05
    seed: int = 0
    reply_tokens: int = 64  # speech pass: reply tokens the thinker generates per conversation
    speech_frames: int = 128  # speech pass: codec frames the talker generates at most (~10 s of speech)
    min_speech_frames: int = 0
    speech_samples: int = 32  # speech pass: conversations run through generate() (plus the held-out ones)
    force: bool = False
    quantize_vision: bool = True  # False: the vision encoder stays BF16 (vLLM-Omni 0.30 needs that)
    sym: bool = True  # symmetric 4-bit: what vLLM's GPTQ kernels take; --asym measures lower error on some layers
    served_model_name: str | None = None  # the model id `serve` answers to; None: qwen3-omni-int<bits>
    progress: bool | None = None  # None: bars when stderr is a terminal
    max_gpu_memory: int = DEFAULT_MAX_GPU_MEMORY  # bytes; the memory plan keeps the run under both
    max_host_memory: int = DEFAULT_MAX_HOST_MEMORY
    activations: str | None = None  # "device", "host" or "disk": where calibration activations live; None: planned
    solver: str = "auto"  # GPTQ solver: "gptqmodel", "own" (quantize/gptq_solve.py) or "auto" (GPTQModel if it imports)

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size,
                         quantize_audio_encoder=self.quantize_audio_encoder,
                         quantize_code_predictor=self.quantize_code_predictor,
                         quantize_code2wav=self.quantize_code2wav, quantize_lm_head=self.quantize_lm_head,
                         sym=self.sym, quantize_vision=self.quantize_vision)


def quantizer_name(cfg: QuantConfig) -> str:
    """The GPTQ solver the run uses, by name and version (the manifest's, the report's and the resume key's)."""
    from .gptq import resolve_solver, solver_name

    return solver_name(resolve_solver(cfg.solver))


def quantization_record(cfg: QuantConfig) -> dict:
    """The manifest's (and the resume key's) record of how the weights were quantized."""
    return {**cfg.spec.describe(), "spec": asdict(cfg.spec), "method": "gptq", "quantizer": quantizer_name(cfg),
            "damp_percent": cfg.damp, "true_sequential": True}


def calibration_source(cfg: QuantConfig) -> str:
    """Where the calibration conversations come from, as messages and the report name it."""
    return cfg.calib or BUILTIN_SOURCE
