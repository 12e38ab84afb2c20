"""The device profile: one frozen object per kind of device, chosen from the device once, printed by `plan` and
`doctor`, changed in tests by building another (dataclasses.replace), never by patching a module."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from orin.device.allocator_conf import AllocatorConf, AllocatorSetting
from orin.device.capabilities import cuda_base_profile, detect
from orin.device.profile import AMPERE, CPU, HOPPER, ORIN, PROFILES, DeviceProfile, for_arch, named
from orin.errors import UsageError


def test_each_device_gets_its_profile():
    assert for_arch(cuda=False) is CPU
    assert for_arch(cuda=True, capability=(8, 7)) is ORIN
    assert for_arch(cuda=True, capability=(8, 6), tegra=True) is ORIN  # any Jetson shares the host's DRAM
    assert for_arch(cuda=True, capability=(9, 0)) is HOPPER and for_arch(cuda=True, capability=(10, 0)) is HOPPER
    assert for_arch(cuda=True, capability=(8, 0)) is AMPERE
    assert ORIN.capabilities.unified_memory and not HOPPER.capabilities.unified_memory
    assert not ORIN.capabilities.cudnn_whole_prompt and HOPPER.capabilities.cudnn_whole_prompt


def test_a_profile_is_named_and_a_wrong_name_says_which_exist():
    assert named("orin") is ORIN and set(PROFILES) == {"cpu", "hopper", "orin", "ampere"}
    with pytest.raises(UsageError, match="not one of cpu, hopper, orin, ampere"):
        named("h200")


def test_the_cpu_engine_counts_its_tensors_exactly_and_gpus_keep_a_margin():
    assert CPU.memory.runtime_margin == 0
    # the engine's dtype and plan's bytes per value come from one place
    assert (CPU.compute_dtype, CPU.compute_dtype_bytes) == ("float32", 4)
    assert all((p.compute_dtype, p.compute_dtype_bytes) == ("bfloat16", 2) for p in (HOPPER, ORIN, AMPERE))
    assert all(p.memory.runtime_margin > 0 for p in (HOPPER, ORIN, AMPERE))


def test_every_orin_assumption_names_fields_that_exist_and_says_why():
    groups = {f.name: getattr(ORIN, f.name) for f in fields(DeviceProfile)}
    for key, why in ORIN.notes:
        assert len(why) > 40, key
        for part in key.split(", "):
            group, _, name = part.partition(".")
            if not name:  # a top-level field (sms, sm_clock_ghz) or a group's name continued from the last one
                assert part in groups or hasattr(ORIN.memory, part), part
            elif name != "*":
                assert hasattr(groups[group], name), part
    rendered = ORIN.render()
    assert rendered.startswith("device profile: orin") and "assumed: sms, sm_clock_ghz" in rendered
    assert "stage_bytes=64MiB" in rendered and "after_mask_max=33554432" in rendered  # bytes as MiB, counts not


def test_a_changed_profile_is_another_object_and_its_methods_follow_it():
    small = replace(CPU, memory=replace(CPU.memory, cache_granule=64))
    assert CPU.memory.cache_positions(65) == 1024 and small.memory.cache_positions(65) == 128
    assert CPU.speech.chunk_count(64) == 7
    fast = replace(CPU, speech=replace(CPU.speech, code2wav_chunk=4))
    assert [fast.speech.chunk_frames(d) for d in (0, 1, 2, 4, 8)] == [1, 2, 3, 4, 4]
    with pytest.raises(AttributeError):
        CPU.memory.cache_granule = 1  # frozen


def test_the_cpu_is_detected_once_with_what_its_torch_runs():
    profile = detect(torch.device("cpu"))
    assert profile.name == "cpu" and not profile.capabilities.cuda and not profile.capabilities.triton
    assert profile.memory == CPU.memory and profile.prefill == CPU.prefill  # only the capabilities are probed


def test_plan_prints_the_profile_it_sizes_with(real_config):
    from click.testing import CliRunner

    from orin.cli import cli

    orin = CliRunner().invoke(cli, ["plan", real_config, "--budget", "24GiB", "--device-profile", "orin"])
    cpu = CliRunner().invoke(cli, ["plan", real_config, "--budget", "24GiB", "--device-profile", "cpu"])
    assert orin.exit_code == 0 and cpu.exit_code == 0, orin.output + cpu.output
    assert "device profile: orin" in orin.output and "+ 768.00 MiB runtime margin" in orin.output
    assert "device profile: cpu" in cpu.output and "+ 0 B runtime margin" in cpu.output


def test_the_allocator_configuration_is_parsed_as_torch_reads_it():
    conf = AllocatorConf.from_environ({
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:True,roundup_power2_divisions:[64:8,>:1]",
        "PYTORCH_ALLOC_CONF": "expandable_segments:False", "OTHER": "expandable_segments:True"})
    cuda, new = conf.settings
    assert (cuda.variable, new.variable) == ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    assert cuda.options == (("max_split_size_mb", "512"), ("expandable_segments", "True"),
                            ("roundup_power2_divisions", "[64:8,>:1]"))
    assert cuda.expandable_segments and not new.expandable_segments and conf.expandable == (cuda,)
    assert cuda.fix() == "export PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:512,roundup_power2_divisions:[64:8,>:1]'"
    # The last mention counts; the only option gone leaves nothing to keep: unset it.
    assert not AllocatorSetting.parse("PYTORCH_ALLOC_CONF", "expandable_segments:True,expandable_segments:False"
                                      ).expandable_segments
    alone = AllocatorSetting.parse("PYTORCH_ALLOC_CONF", "expandable_segments:true")
    assert alone.expandable_segments and alone.fix() == "unset PYTORCH_ALLOC_CONF"
    assert AllocatorConf.from_environ({"PYTORCH_CUDA_ALLOC_CONF": ""}).settings == ()
    assert AllocatorConf().describe() == "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset"


def test_a_tegra_device_refuses_expandable_segments_naming_the_variable_and_the_fix():
    expandable = AllocatorConf.from_environ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64"})
    with pytest.raises(UsageError) as refused:
        cuda_base_profile((8, 7), tegra=True, allocator=expandable)
    message = str(refused.value)
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True,max_split_size_mb:64'" in message
    assert "export PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:64'" in message and "Tegra" in message
    assert refused.value.exit_code == 2
    # The same environment runs on a discrete GPU, and the Orin runs without the option.
    assert cuda_base_profile((9, 0), tegra=False, allocator=expandable) is HOPPER
    assert cuda_base_profile((8, 7), tegra=True, allocator=AllocatorConf()) is ORIN
    fine = AllocatorConf.from_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert cuda_base_profile((8, 7), tegra=True, allocator=fine) is ORIN
    # The CPU engine never asks the CUDA allocator for memory: nothing to refuse.
    assert detect(torch.device("cpu"), allocator=expandable).name == "cpu"
