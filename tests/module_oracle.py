"""Checks shared by the tests of orin-omni's own modules against the transformers modules they replace."""

from __future__ import annotations

import torch


def assert_same_tree(models, hf) -> None:
    """Each of `models` (built on the meta device) has `hf`'s parameter names, shapes and dtypes, all on meta, and
    `hf`'s buffers, real and equal: the loader can assign the checkpoint's tensors into it by name."""
    expected = {n: (p.shape, p.dtype) for n, p in hf.named_parameters()}
    for model in models:
        assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == expected
        assert all(p.is_meta for p in model.parameters())
        buffers = dict(model.named_buffers())
        assert sorted(buffers) == sorted(dict(hf.named_buffers()))
        for name, buf in hf.named_buffers():
            assert not buffers[name].is_meta and torch.equal(buffers[name], buf), name


def real_meta_trees(real_config: str, section: str, hf_class, our_class):
    """The real config's `thinker_config.<section>` encoder on meta: transformers' (the oracle), ours built under
    the loader's params_on_meta (its skeleton) and ours built with device="meta", and transformers' parameter
    shapes and dtypes by name."""
    from orin.memory.skeleton import params_on_meta
    from orin.model.config_file import read_config_dict
    from quantize.hf_config import load_config

    with params_on_meta():
        hf = hf_class(getattr(load_config(real_config).thinker_config, section))
    data = read_config_dict(real_config)["thinker_config"][section]
    with params_on_meta():
        skeleton = our_class(data)
    ours = our_class(data, device="meta")
    return hf, skeleton, ours, {n: (p.shape, p.dtype) for n, p in hf.named_parameters()}


def checkpoint_state(model_dir, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under `prefix` (e.g. "code2wav."), renamed relative to it, in float32."""
    from pathlib import Path

    from safetensors.torch import load_file

    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    return {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}


def random_state(model: torch.nn.Module, seed: int, matrix_scale: float = 0.5) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` drawn afresh: vectors (norms, biases, snake parameters) moved off
    their init, matrices at `matrix_scale` / sqrt(fan-in). A freshly initialised model has identity norms, zero
    biases and near-identity layer scales, which would hide a wrong path."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in sorted(model.state_dict().items()):
        noise = torch.randn(p.shape, generator=gen)
        state[name] = p + 0.3 * noise if p.dim() == 1 else matrix_scale * noise / p[0].numel() ** 0.5
    return state


def hf_prompt_inputs(hf_processor, messages, device: str = "cpu") -> dict:
    """A request's messages through transformers' processor (quantize.hf_processor.build_processor), as the engine
    prepared them before it had its own processor: the oracle for orin.inputs and the positions."""
    from orin.inputs.placeholders import split_media

    conv = split_media(messages)
    text = hf_processor.apply_chat_template(conv.messages, add_generation_prompt=True, tokenize=False)
    extra = {"device": device} if conv.audios and device != "cpu" else {}
    return dict(hf_processor(text=[text], images=conv.images or None, audio=conv.audios or None,
                             return_tensors="pt", padding=True, **extra))


def hf_twin(model, model_dir):
    """transformers' Qwen3OmniMoeForConditionalGeneration holding the very tensors of orin-omni's loaded `model`
    (orin.model.omni.OmniModel, the same parameter names): parameters shared, INT4 shells shared as modules, HF's own
    buffers (rotary tables) moved to the model's device. The oracle then runs on exactly the weights the engine
    runs. Build it after the components it will touch are resident: a later swap gives the engine new tensors."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from orin.int4.linear import Int4Experts, Int4Linear
    from orin.memory.skeleton import params_on_meta
    from quantize.hf_config import load_config

    with params_on_meta():
        hf = Qwen3OmniMoeForConditionalGeneration(load_config(model_dir))
    hf.eval()
    device = next(p for p in model.parameters() if not p.is_meta).device
    for path, module in model.named_modules():
        if isinstance(module, (Int4Linear, Int4Experts)):
            parent, _, child = path.rpartition(".")
            setattr(hf.get_submodule(parent), child, module)
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        hf.get_submodule(owner)._parameters[attr] = param
    for owner in hf.modules():
        for name, buf in list(owner._buffers.items()):
            if buf is not None and not buf.is_meta:
                owner._buffers[name] = buf.to(device)
    return hf
