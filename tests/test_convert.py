"""`orin-omni convert`: an orin-omni 0.1 checkpoint of the tiny model, written here in the old format (one
directory per segment, runtime names, asymmetric GPTQ tensors zero-padded to the group size, the vision
linear_fc2 in INT4, manifest schema 1), rewritten in the standard layout; both load into the same runtime."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from orin import components as C
from orin.checkpoint.convert import SYM_NOTE, ConvertConfig, convert_checkpoint
from orin.checkpoint.files import INDEX_NAME, VISION_FC2_RULE, read_header
from orin.checkpoint.gptq_format import decode_qzeros_v1, dequantize_gptq_v1, pad_in_features, quantize_rtn
from orin.checkpoint.hub_names import expert_part, to_hub, to_runtime
from orin.checkpoint.manifest import Manifest, SegmentEntry, file_entry, read_manifest, verify_files, write_manifest
from orin.cli import cli
from orin.errors import ChecksumError, UsageError
from orin.fsutil import sha256_file

G = 128
# 0.1's INT4 targets under the default settings (its orin.checkpoint.targets rules): the vision MLP's fc2 was one of them.
OLD_TARGETS = re.compile(
    r"^(thinker\.model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts|mlp\.(gate|up|down)_proj)"
    r"|thinker\.model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
    r"|talker\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts|mlp\.shared_expert\.(gate|up|down)_proj))$")
OLD_SHARED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
              "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json", "orin_tiny.json")
FC2 = re.compile(VISION_FC2_RULE.removeprefix("-:"))
RUNTIME_PREFIXES = ("thinker.model.language_model.", "thinker.model.visual.", "thinker.model.audio_tower.")


# ---------------------------------------------------------------------- an orin-omni 0.1 checkpoint


def bf16_runtime_state(model_dir: str) -> dict[str, torch.Tensor]:
    """The tiny model's tensors under runtime names, per-expert weights fused as transformers holds them."""
    state, experts = {}, {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for key, tensor in load_file(file).items():
            runtime = to_runtime(key)
            part = expert_part(runtime)
            if part is None:
                state[runtime] = tensor
            else:
                experts.setdefault(part.fused, {})[(part.expert, part.half)] = tensor
    for fused, parts in experts.items():
        E = 1 + max(e for e, _ in parts)
        if fused.endswith("gate_up_proj"):
            state[fused] = torch.stack([torch.cat([parts[(e, 0)], parts[(e, 1)]]) for e in range(E)])
        else:
            state[fused] = torch.stack([parts[(e, 0)] for e in range(E)])
    return state


def old_gptq(W: torch.Tensor, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """0.1's asymmetric GPTQ v1 tensors of one Linear: inputs zero-padded to a multiple of the group size, i.e.
    qweight rows up to K_pad/8 holding the last group's zero point, g_idx over K_pad."""
    t = quantize_rtn(W, 4, G, sym=False, bias=bias)
    N, K = W.shape
    K_pad = pad_in_features(K, G)
    if K_pad > K:
        words = decode_qzeros_v1(t["qzeros"])[-1].to(torch.int64) * 0x11111111  # the zero point in every nibble
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        t["qweight"] = torch.cat([t["qweight"], words.expand(K_pad // 8 - t["qweight"].shape[0], N)])
        t["g_idx"] = torch.arange(K_pad, dtype=torch.int32) // G
    return t


def write_v01_checkpoint(model_dir: str, out: Path) -> dict[str, torch.Tensor]:
    """Quantize the tiny model (RTN) into orin-omni 0.1's layout at `out`; returns its BF16 runtime state."""
    bf16 = bf16_runtime_state(model_dir)
    state = dict(bf16)
    targets: list[str] = []
    for name in sorted({k.rpartition(".")[0] for k in bf16}):
        if not OLD_TARGETS.match(name):
            continue
        targets.append(name)
        if name.endswith(".experts"):
            gate_up, down = state.pop(f"{name}.gate_up_proj"), state.pop(f"{name}.down_proj")
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                for proj, W in (("gate_proj", gate_up[e, :inter]), ("up_proj", gate_up[e, inter:]),
                                ("down_proj", down[e])):
                    state.update({f"{name}.{e}.{proj}.{k}": v for k, v in old_gptq(W).items()})
        else:
            tensors = old_gptq(state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None))
            state.update({f"{name}.{k}": v for k, v in tensors.items()})
    out.mkdir(parents=True)
    shared_names = [n for n in OLD_SHARED if (Path(model_dir) / n).is_file()]
    for n in shared_names:
        shutil.copyfile(Path(model_dir) / n, out / n)
    segments = {}
    for seg, comps in C.DEFAULT_SEGMENTS.items():
        (out / seg).mkdir()
        save_file({k: v.contiguous() for k, v in state.items() if C.component_of(k) in comps},
                  str(out / seg / "model.safetensors"), metadata={"format": "pt", "orin_segment": seg})
        shutil.copyfile(Path(model_dir) / "config.json", out / seg / "config.json")
        mods = [t for t in targets if C.component_of(t + ".") in comps]
        (out / seg / "quantize_config.json").write_text(json.dumps({
            "bits": 4, "group_size": G, "desc_act": False, "sym": False, "quant_method": "gptq",
            "checkpoint_format": "gptq", "segment": seg, "components": list(comps), "modules": mods}))
        files = tuple(file_entry(out, f"{seg}/{f}") for f in ("model.safetensors", "config.json",
                                                              "quantize_config.json"))
        segments[seg] = SegmentEntry(
            name=seg, components=comps, files=files, total_bytes=sum(f.bytes for f in files),
            int4_bytes=(out / seg / "model.safetensors").stat().st_size, quantized_modules=tuple(mods),
            started_at="2025-01-01T00:00:00Z", finished_at="2025-01-01T00:01:00Z",
            extra={"calibration": {"source": "built-in synthetic set"}})
    spec = {"bits": 4, "group_size": G, "quantize_audio_encoder": False, "quantize_code_predictor": False,
            "quantize_code2wav": False, "quantize_lm_head": False}
    write_manifest(out, Manifest(
        tool_version="0.1.0", created_at="2025-01-01T00:00:00Z",
        source={"model_dir": model_dir, "config_sha256": sha256_file(Path(model_dir) / "config.json")},
        quantization={"bits": 4, "group_size": G, "format": "gptq_v1", "sym": False, "desc_act": False,
                      "spec": spec, "method": "gptq", "quantizer": "rtn", "damp_percent": 0.05,
                      "true_sequential": True},
        split=dict(C.DEFAULT_SEGMENTS), shared_files=tuple(file_entry(out, n) for n in shared_names),
        segments=segments, served_model_name="tiny-int4", schema_version=1))
    return bf16


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """(old 0.1 checkpoint, its conversion, the BF16 runtime state it was quantized from, convert's log)."""
    root = tmp_path_factory.mktemp("convert")
    bf16 = write_v01_checkpoint(tiny_model_dir, root / "v01")
    lines: list[str] = []
    out = convert_checkpoint(ConvertConfig(model_dir=str(root / "v01"), out=str(root / "std")), log=lines.append)
    return root / "v01", out, bf16, lines


def shard_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def true_in_features(bf16: dict, linear: str) -> int:
    """K of a runtime Linear (experts: one expert's projection) from the BF16 weights."""
    experts, _, proj = linear.rpartition(".")
    if proj in ("gate_proj", "up_proj", "down_proj") and experts.rpartition(".")[0].endswith(".experts"):
        fused = experts.rpartition(".")[0] + (".down_proj" if proj == "down_proj" else ".gate_up_proj")
        return bf16[fused].shape[2]
    return bf16[f"{linear}.weight"].shape[1]


# ---------------------------------------------------------------------- the standard layout


def test_convert_writes_the_standard_layout(converted):
    old, out, bf16, lines = converted
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "quantize_config.json", "manifest.json", INDEX_NAME, "tokenizer.json",
            "chat_template.jinja", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= names
    assert not any((out / seg).exists() for seg in C.DEFAULT_SEGMENTS)  # no per-segment directories
    assert any(SYM_NOTE in line for line in lines)

    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    headers = {s: read_header(out / s) for s in ("model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors")}
    assert index == {k: s for s, h in headers.items() for k in h}
    # The thinker's shard holds exactly the thinker segment's components, the other the rest.
    assert {C.component_of(to_runtime(k)) for k in headers["model-00001-of-00002.safetensors"]} == \
        set(C.DEFAULT_SEGMENTS["thinker"])
    for key in index:
        assert to_hub(key) == key and not key.startswith(RUNTIME_PREFIXES), key
        assert ".experts.gate_up_proj" not in key and ".experts.down_proj" not in key

    tensors = shard_tensors(out)
    qweights = [k for k in tensors if k.endswith(".qweight")]
    assert qweights and any(".experts.3.down_proj." in k for k in qweights)
    for key in qweights:
        module = key.removesuffix(".qweight")
        K = true_in_features(bf16, to_runtime(module))
        assert tensors[key].shape[0] == -(-K // 8), key
        assert tensors[f"{module}.g_idx"].tolist() == [k // G for k in range(K)], key
    assert not any(FC2.fullmatch(to_runtime(k.rpartition(".")[0])) for k in qweights)


def test_quantization_config_lists_what_is_still_quantized(converted):
    old, out, bf16, _ = converted
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q == json.loads((out / "quantize_config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == \
        json.loads((old / "config.json").read_text())
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"]) == ("gptq", 4, G, False, False)
    assert q["damp_percent"] == 0.05 and q["meta"]["quantizer"] == ["rtn"]
    assert VISION_FC2_RULE in q["dynamic"] and r"-:.*audio_tower\..*" in q["dynamic"]
    entries = q["modules_in_block_to_quantize"][0]
    assert "thinker.visual.blocks.0.attn.qkv" in entries and "thinker.model.visual.blocks.0.mlp.linear_fc1" in entries
    assert "mlp.experts.0.gate_proj" in entries  # every MoE layer's experts are quantized: the short form
    assert not any("linear_fc2" in e for e in entries)


def test_manifest_is_schema_2_and_verifies(converted):
    old, out, _, _ = converted
    before, after = read_manifest(old), read_manifest(out)
    assert after.schema_version == 2
    verify_files(out, after)
    assert after.complete and after.split == before.split
    assert (after.tool_version, after.served_model_name) == (before.tool_version, "tiny-int4")
    assert after.source["config_sha256"] == before.source["config_sha256"]
    assert after.source["converted_from"]["schema_version"] == 1
    assert after.quant_spec().sym is False and after.quantization["sym"] is False
    assert {f.path for f in after.shared_files} == {f.path for f in before.shared_files} | {"quantize_config.json"}
    for name, seg in after.segments.items():
        was = before.segments[name]
        (shard,) = seg.files
        assert shard.path.startswith("model-0000") and (out / shard.path).is_file()
        header = read_header(out / shard.path)
        assert seg.int4_bytes == sum(i["data_offsets"][1] - i["data_offsets"][0] for i in header.values())
        assert seg.total_bytes == shard.bytes and seg.extra == was.extra and seg.components == was.components
        assert set(seg.quantized_modules) == {m for m in was.quantized_modules if not FC2.fullmatch(m)}
    assert any(FC2.fullmatch(m) for m in before.segments["talker_vision"].quantized_modules)


def test_vision_fc2_becomes_its_dequantized_int4_weight(converted):
    old, out, bf16, _ = converted
    new = shard_tensors(out)
    with safe_open(str(old / "talker_vision" / "model.safetensors"), framework="pt") as reader:
        blocks = sorted({k.rpartition(".")[0] for k in reader.keys() if FC2.fullmatch(k.rpartition(".")[0])})
        assert len(blocks) == 3
        for path in blocks:
            t = {s: reader.get_tensor(f"{path}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx", "bias")}
            K = bf16[f"{path}.weight"].shape[1]
            assert K % G and t["qweight"].shape[0] == pad_in_features(K, G) // 8  # the old file really padded
            hub = to_hub(path)
            assert f"{hub}.qweight" not in new
            assert new[f"{hub}.weight"].dtype == torch.bfloat16
            assert torch.equal(new[f"{hub}.weight"], dequantize_gptq_v1(t, K).to(torch.bfloat16))
            assert torch.equal(new[f"{hub}.bias"], t["bias"])


def test_old_and_converted_load_to_the_same_model(converted, caplog):
    from orin.checkpoint.reader import Checkpoint
    from orin.int4.linear import Int4Linear
    from orin.memory.loader import Loader

    old, out, bf16, _ = converted
    with caplog.at_level(logging.WARNING, logger="orin.checkpoint.reader"):
        old_ckpt = Checkpoint.open(old)
    assert any("orin-omni convert" in r.getMessage() and "--out" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orin.checkpoint.reader"):
        new_ckpt = Checkpoint.open(out)
    assert not any("orin-omni convert" in r.getMessage() for r in caplog.records)

    loaders = [Loader(ckpt, torch.device("cpu"), torch.bfloat16) for ckpt in (old_ckpt, new_ckpt)]
    try:
        for loader in loaders:
            for comp in C.NAMES:
                loader.ensure(comp)
        old_model, new_model = (ld.model for ld in loaders)
        fc2 = {p for p in loaders[0].shells if FC2.fullmatch(p)}
        assert len(fc2) == 3 and set(loaders[1].shells) == set(loaders[0].shells) - fc2

        old_params, new_params = dict(old_model.named_parameters()), dict(new_model.named_parameters())
        assert set(new_params) == set(old_params) | {f"{p}.{s}" for p in fc2 for s in ("weight", "bias")}
        for name, p in old_params.items():
            assert torch.equal(p, new_params[name]), name
        for path, shell in loaders[0].shells.items():
            if path in fc2:
                continue
            mine = dict(loaders[1].shells[path].named_buffers())
            theirs = dict(shell.named_buffers())
            assert theirs and set(mine) == set(theirs), path
            for key, buf in theirs.items():
                assert torch.equal(buf, mine[key]), f"{path}.{key}"

        gen = torch.Generator().manual_seed(0)
        for path in ("thinker.model.language_model.layers.1.self_attn.q_proj", "thinker.model.visual.blocks.2.attn.qkv",
                     "talker.model.layers.0.mlp.shared_expert.down_proj"):
            a, b = old_model.get_submodule(path), new_model.get_submodule(path)
            assert isinstance(a, Int4Linear) and isinstance(b, Int4Linear)
            x = torch.randn(5, a.in_features, generator=gen).to(torch.bfloat16)
            assert torch.equal(a(x), b(x)), path

        with safe_open(str(old / "talker_vision" / "model.safetensors"), framework="pt") as reader:
            for path in sorted(fc2):
                a, b = old_model.get_submodule(path), new_model.get_submodule(path)
                assert isinstance(a, Int4Linear) and isinstance(b, torch.nn.Linear)
                t = {s: reader.get_tensor(f"{path}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")}
                assert torch.equal(b.weight, dequantize_gptq_v1(t, b.in_features).to(torch.bfloat16))
                x = torch.randn(7, b.in_features, generator=gen).to(torch.bfloat16)
                ya, yb = a(x).float(), b(x).float()
                # The INT4 kernel and the BF16 GEMM round differently; the weights are the same.
                assert (ya - yb).norm() <= 0.02 * yb.norm(), path
    finally:
        for loader in loaders:
            loader.close()


# ---------------------------------------------------------------------- refusals and the CLI


def test_existing_out_is_refused_without_force_and_left_intact(converted, tmp_path):
    old, out, _, _ = converted
    before = {p.name: sha256_file(p) for p in out.iterdir()}
    with pytest.raises(UsageError, match="exists and is not empty; pass --force"):
        convert_checkpoint(ConvertConfig(model_dir=str(old), out=str(out)))
    assert {p.name: sha256_file(p) for p in out.iterdir()} == before

    target = tmp_path / "again"
    target.mkdir()
    (target / "stale.txt").write_text("left by something else")
    convert_checkpoint(ConvertConfig(model_dir=str(old), out=str(target), force=True))
    assert not (target / "stale.txt").exists()
    assert {p.name: sha256_file(p) for p in target.iterdir() if p.name != "manifest.json"} == \
        {n: s for n, s in before.items() if n != "manifest.json"}


def test_refuses_what_it_cannot_convert(converted, tmp_path):
    old, out, _, _ = converted
    with pytest.raises(UsageError, match="already in the standard layout"):
        convert_checkpoint(ConvertConfig(model_dir=str(out), out=str(tmp_path / "x")))
    with pytest.raises(UsageError, match="would replace the checkpoint being converted"):
        convert_checkpoint(ConvertConfig(model_dir=str(old), out=str(old), force=True))

    damaged = tmp_path / "damaged"
    shutil.copytree(old, damaged)
    shard = damaged / "thinker" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="sha256"):
        convert_checkpoint(ConvertConfig(model_dir=str(damaged), out=str(tmp_path / "y")))
    assert not (tmp_path / "y").exists()


def test_cli_convert(converted, tmp_path):
    old, _, _, _ = converted
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(old), "--out", str(tmp_path / "std"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["sym"] is False and summary["finished"] == list(C.DEFAULT_SEGMENTS)
    assert "vLLM" in result.stderr and "--sym" in result.stderr

    result = runner.invoke(cli, ["convert", str(old), "--out", str(tmp_path / "std")])
    assert result.exit_code == 2 and "--force" in result.output
    result = runner.invoke(cli, ["convert", str(old), "--out", str(tmp_path / "std"), "--force"])
    assert result.exit_code == 0, result.output
    assert "standard GPTQ checkpoint written to" in result.output and "vLLM" in result.output
    verify_files(tmp_path / "std", read_manifest(tmp_path / "std"))
