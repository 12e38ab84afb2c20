"""transformers' Qwen3-Omni processor, for the workstation side (quantize's calibration), the HF reference of the
benchmark and the tests' oracle; the device prepares prompts with orin.inputs, its own. Built in code:
AutoProcessor cannot load it here, its video processor needs torchvision. Images and audio need only these three
parts."""

from __future__ import annotations

from pathlib import Path

from orin.audio_format import INPUT_SAMPLE_RATE
from orin.errors import ModelError


def build_processor(model_dir: str | Path):
    """The processor of the checkpoint in `model_dir`: its tokenizer and its own chat template
    (chat_template.jinja, else the tokenizer's)."""
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else tokenizer.chat_template
    if not template:
        raise ModelError(f"{model_dir} has no chat template (chat_template.jinja or the tokenizer's); "
                         "copy the model's chat_template.jinja beside its config.json")
    return make_processor(tokenizer, template)


def make_processor(tokenizer, chat_template: str):
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=INPUT_SAMPLE_RATE)
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    return _processor_class()(image_processor, feature_extractor, tokenizer, chat_template=chat_template)


def _processor_class():
    from transformers import Qwen3OmniMoeProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageAudioProcessor(Qwen3OmniMoeProcessor):
        """Qwen3OmniMoeProcessor without its video processor: ProcessorMixin checks every sub-processor's class,
        and the video one's class does not exist without torchvision."""

        def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
            ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
            self.video_processor = None
            for name in ("image", "audio", "video"):
                setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))
                setattr(self, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
            for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
                setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))

    return ImageAudioProcessor


