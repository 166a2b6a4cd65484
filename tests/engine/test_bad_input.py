"""Bad input ends in one clear exception that names the file (or field, tensor, argument), and
PyTorch .bin checkpoints load and convert: damaged safetensors, bad config.json, .bin without torch,
sharded .bin, unused tensors, damaged Orbax checkpoints, conversions that would overwrite, and the
demo's arguments."""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflash_jax.cli import common  # noqa: E402
from dflash_jax.convert import main as convert  # noqa: E402
from dflash_jax._errors import CheckpointError, ConfigError, TorchRequiredError  # noqa: E402
from dflash_jax.loading.drafter_io import load_drafter, save_drafter  # noqa: E402
from dflash_jax.formats.safetensors_io import SafetensorsFile, save_safetensors  # noqa: E402
from dflash_jax.loading.target_loader import load_target  # noqa: E402
from support.dflash_torch_reference import drafter_hf_config, write_official_checkpoint  # noqa: E402
from infer.generate import main as generate_cli  # noqa: E402
from support.families import make_hf  # noqa: E402


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    make_hf("qwen3", d)
    return d


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    write_official_checkpoint(d, drafter_hf_config(layers=1, target_layer_ids=(1,)))
    return d


def clone(src, dst, config_edit=None):
    shutil.copytree(src, dst)
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def assert_one_error_line(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert str(fragment) in err[0], (fragment, err[0])
    return err[0]


# ----------------------------------------------------------------------------- safetensors


def _header(entries: dict) -> bytes:
    blob = json.dumps(entries).encode()
    return struct.pack("<Q", len(blob)) + blob


DAMAGED_FILES = {
    "empty": (b"", "too short"),
    "garbage header length": (b"\xff" * 8 + b"{}", "header length"),
    "header not JSON": (struct.pack("<Q", 4) + b"\x00abc", "not valid JSON"),
    "unknown dtype": (_header({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}) + b"\0" * 4,
                      "unknown dtype 'Q7'"),
    "bad shape": (_header({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}) + b"\0" * 4,
                  "invalid shape"),
    "size mismatch": (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}) + b"\0" * 4,
                      "needs 8 bytes"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_FILES))
def test_damaged_safetensors_names_the_file(tmp_path, case):
    content, problem = DAMAGED_FILES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=problem) as info:
        SafetensorsFile(path)
    assert type(info.value) is CheckpointError
    assert f"damaged safetensors file {path}" in str(info.value)


def test_truncated_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    save_safetensors({"a": np.ones((4, 4), np.float32), "b": np.ones(8, np.float32)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"tensor 'b' ends at byte 96 .* only 86 bytes \(truncated"):
        SafetensorsFile(path)


def test_generate_cli_with_garbage_weights_prints_one_error_line(target_dir, tmp_path, capsys):
    d = clone(target_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 3)
    assert generate_cli(["--target", str(d), "--no-draft", "--prompt", "hi"]) == 2
    assert_one_error_line(capsys, f"damaged safetensors file {d / 'model.safetensors'}")


# ------------------------------------------------------------------------------ config.json


@pytest.mark.parametrize("kind,edit,message", [
    ("target", lambda c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
    ("target", lambda c: c.update(hidden_size="64"), "field 'hidden_size' must be an integer, got '64'"),
    ("target", lambda c: c.update(tie_word_embeddings="no"), "field 'tie_word_embeddings' must be true or false"),
    ("target", lambda c: c.update(rms_norm_eps=[1]), "field 'rms_norm_eps' must be a number"),
    ("target", lambda c: c.update(num_attention_heads=0), "num_heads must be positive"),
    ("drafter", lambda c: c.pop("num_hidden_layers"), "missing required field 'num_hidden_layers'"),
    ("drafter", lambda c: c.update(hidden_size="576"), "field 'hidden_size' must be an integer"),
    ("drafter", lambda c: c["dflash_config"].update(mask_token_id="7"), "field 'dflash_config.mask_token_id'"),
    ("drafter", lambda c: c["dflash_config"].update(target_layer_ids=[1.5]),
     "'dflash_config.target_layer_ids' must be a list of integers"),
])
def test_bad_config_names_file_and_field(request, tmp_path, kind, edit, message):
    d = clone(request.getfixturevalue(f"{kind}_dir"), tmp_path / kind, edit)
    load = load_target if kind == "target" else load_drafter
    with pytest.raises(ConfigError, match=message) as info:
        load(d)
    assert type(info.value) is ConfigError
    assert str(info.value).startswith(f"{d / 'config.json'}: ")


def test_invalid_json_names_the_file(target_dir, tmp_path, capsys):
    d = clone(target_dir, tmp_path / "m")
    (d / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match=r"not valid JSON .*line 1") as info:
        load_target(d)
    assert str(d / "config.json") in str(info.value)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_target(d)
    (d / "generation_config.json").write_text("{")
    (d / "config.json").write_text((target_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="generation_config.json: not valid JSON"):
        load_target(d)


def test_convert_with_bad_config_prints_one_error_line(drafter_dir, tmp_path, capsys):
    d = clone(drafter_dir, tmp_path / "d", lambda c: c.pop("hidden_size"))
    assert convert(["to-orbax", str(d), str(tmp_path / "o")]) == 2
    assert_one_error_line(capsys, d / "config.json", "'hidden_size'")


# -------------------------------------------------------------------- tensors and the head


def test_tied_config_with_a_different_lm_head_is_an_error(target_dir, tmp_path):
    d = clone(target_dir, tmp_path / "m", lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(CheckpointError, match="lm_head.weight that differs from model.embed_tokens.weight") as info:
        load_target(d)
    assert str(d) in str(info.value)
    # A stored head that IS the embedding (some exports save both) is accepted.
    tensors = {k: np.array(v) for k, v in SafetensorsFile(d / "model.safetensors").items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_safetensors(tensors, d / "model.safetensors")
    assert load_target(d).config.tie_word_embeddings


# --------------------------------------------------------------------------- PyTorch .bin


def _bin_copy(src, dst, shards: int):
    """src's tensors as pytorch_model.bin (shards == 1) or `shards` files plus an index."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in SafetensorsFile(src / "model.safetensors").items()}
    names = sorted(tensors)
    if shards == 1:
        torch.save(tensors, dst / "pytorch_model.bin")
        return dst
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: tensors[n] for n in part}, dst / fname)
        weight_map.update({n: fname for n in part})
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards", [1, 2])
def test_bin_drafter_loads_and_converts_to_safetensors(drafter_dir, tmp_path, shards):
    src = _bin_copy(drafter_dir, tmp_path / "bin", shards)
    want = SafetensorsFile(drafter_dir / "model.safetensors")
    loaded = load_drafter(src)
    again = load_drafter(drafter_dir)
    np.testing.assert_array_equal(loaded.params["fc"]["kernel"], again.params["fc"]["kernel"])
    assert convert(["to-hf", str(src), str(tmp_path / "hf")]) == 0
    got = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert convert(["to-orbax", str(src), str(tmp_path / "orbax")]) == 0
    assert (tmp_path / "orbax" / "params").is_dir()


def test_bf16_bin_keeps_its_dtype(drafter_dir, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    config = json.loads((drafter_dir / "config.json").read_text())
    config["torch_dtype"], config["dtype"] = "bfloat16", None
    (src / "config.json").write_text(json.dumps(config))
    tensors = {k: torch.from_numpy(np.array(v)).bfloat16()
               for k, v in SafetensorsFile(drafter_dir / "model.safetensors").items()}
    torch.save(tensors, src / "pytorch_model.bin")
    assert convert(["to-hf", str(src), str(tmp_path / "hf")]) == 0
    got = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    for name, tensor in tensors.items():
        assert got[name].dtype.name == "bfloat16"
        np.testing.assert_array_equal(got[name].view(np.int16), tensor.view(torch.int16).numpy())


def test_bin_without_torch_is_one_clear_error(target_dir, drafter_dir, tmp_path, monkeypatch, capsys):
    target_bin = _bin_copy(target_dir, tmp_path / "target-bin", 1)
    drafter_bin = _bin_copy(drafter_dir, tmp_path / "drafter-bin", 2)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(TorchRequiredError, match="torch is not installed.*pip install torch") as info:
        load_target(target_bin)
    assert str(target_bin / "pytorch_model.bin") in str(info.value)
    assert isinstance(info.value, ImportError) and isinstance(info.value, ValueError)
    with pytest.raises(TorchRequiredError, match="dflash_jax.convert"):
        load_drafter(drafter_bin)
    assert generate_cli(["--target", str(target_bin), "--no-draft", "--prompt", "hi"]) == 2
    assert_one_error_line(capsys, "torch is not installed", target_bin)
    assert convert(["to-hf", str(drafter_bin), str(tmp_path / "out")]) == 2
    assert_one_error_line(capsys, "torch is not installed")


def test_damaged_bin_names_the_file(drafter_dir, tmp_path):
    src = _bin_copy(drafter_dir, tmp_path / "bin", 1)
    (src / "pytorch_model.bin").write_bytes(b"not a zip file")
    with pytest.raises(CheckpointError, match=f"damaged PyTorch checkpoint {src / 'pytorch_model.bin'}"):
        load_drafter(src)


# ------------------------------------------------------------------ writing and Orbax damage


def test_to_hf_refuses_to_overwrite_unless_forced(drafter_dir, tmp_path, capsys, monkeypatch):
    orbax = tmp_path / "orbax"
    assert convert(["to-orbax", str(drafter_dir), str(orbax)]) == 0
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert convert(["to-hf", str(orbax), str(dst)]) == 2
    assert_one_error_line(capsys, dst, "--force")
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]

    def fail(*args, **kwargs):
        raise OSError("disk full")
    import dflash_jax.loading.drafter_io as drafter_io
    monkeypatch.setattr(drafter_io, "save_safetensors", fail)
    assert convert(["to-hf", str(orbax), str(dst), "--force"]) == 2
    assert_one_error_line(capsys, "disk full")
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]  # untouched by the failed write
    monkeypatch.undo()
    assert convert(["to-hf", str(orbax), str(dst), "--force"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "orbax"]  # no temporary left behind
    with pytest.raises(FileExistsError, match="not empty"):
        save_drafter(load_drafter(dst), dst)


@pytest.mark.parametrize("damage,what", [
    (lambda p: (p / "_METADATA").unlink(), "_METADATA"),
    (lambda p: (p / "manifest.ocdbt").unlink(), "does not exist"),
    (lambda p: [f.write_bytes(f.read_bytes()[:5]) for f in (p / "ocdbt.process_0" / "d").iterdir()],
     "Error reading"),
])
def test_damaged_orbax_is_one_readable_line(drafter_dir, tmp_path, capsys, damage, what):
    orbax = tmp_path / "orbax"
    assert convert(["to-orbax", str(drafter_dir), str(orbax)]) == 0
    damage(orbax / "params")
    assert convert(["to-hf", str(orbax), str(tmp_path / "hf")]) == 2
    line = assert_one_error_line(capsys, f"damaged Orbax checkpoint {orbax / 'params'}", what)
    assert len(line) < 500 and "tensorstore_spec" not in line


# -------------------------------------------------------------------------------- CLI bits


def test_exit_process_flushes_piped_output_and_keeps_the_status():
    code = ("import logging, sys; from dflash_jax.cli.common import exit_process; "
            "logging.basicConfig(stream=sys.stderr); logging.warning('last words'); "
            "print('answer', end=''); sys.stderr.write('note'); exit_process(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 3
    assert out.stdout == "answer" and "last words" in out.stderr and out.stderr.endswith("note")


def test_demo_help_does_not_run_the_demo():
    out = subprocess.run([sys.executable, "-m", "infer.demo", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--prompt", "--drafter", "--max-new-tokens"):
        assert flag in out.stdout
    assert "demo finished" not in out.stdout


def test_demo_honours_its_arguments(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import dflash_jax.cli.demo as demo

    missing = tmp_path / "no-drafter"
    assert demo.main(["--drafter", str(missing)]) == 2
    assert_one_error_line(capsys, f"drafter path does not exist: {missing}")

    calls = []
    tokenizer = SimpleNamespace(chat_template=None, eos_token_id=None,
                                decode=lambda ids, skip_special_tokens: "answer")
    target = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(num_layers=1, hidden_size=8,
                                                                         eos_token_ids=()))
    monkeypatch.setattr(demo, "resolve_target_path", lambda path: (tmp_path / "t.gguf", True))
    monkeypatch.setattr(demo, "load_models", lambda t, d, dtype, **kwargs: (target, None))
    monkeypatch.setattr(demo, "encode_prompt", lambda tok, text: [len(text)])

    def fake_generate(target, drafter, ids, warmup, **kwargs):
        calls.append((ids, kwargs["max_new_tokens"]))
        return SimpleNamespace(tokens=[[5]], num_cycles=[1], block_size=1, prefill_seconds=0.0,
                               decode_seconds=1.0, tokens_per_second=1.0, decode_tokens_per_second=1.0,
                               compile_seconds=0.0, text=lambda tokenizer: "answer")
    def fake_stream(target, drafter, ids, **kwargs):
        calls.append(("streamed", ids, kwargs["max_new_tokens"]))
        return SimpleNamespace(tokens=[5])
    monkeypatch.setattr(demo, "generate_measured", fake_generate)
    monkeypatch.setattr(demo, "stream_answer", fake_stream)
    assert demo.main(["--prompt", "Why is the sky blue?", "--max-new-tokens", "7"]) == 0
    assert calls == [("streamed", [len("Why is the sky blue?")], 7), ([len("Why is the sky blue?")], 7)]
    assert ">>> Why is the sky blue?" in capsys.readouterr().out


def test_greedy_compare_explains_bfloat16_flips():
    assert common.compare_outputs([1, 2, 3], [1, 2, 3], 0.0, "float32") == "identical"
    line = common.compare_outputs([1, 2, 3, 4], [1, 2, 9, 4], 0.0, "bfloat16")
    assert "from new token 2 on" in line and "expected in bfloat16" in line and "!" not in line
    assert "should be identical" in common.compare_outputs([1, 2], [1, 3], 0.0, "float32")
    assert "identically distributed" in common.compare_outputs([1], [2], 0.7, "float32")
    assert "from new token 2 on" in common.compare_outputs([1, 2], [1, 2, 3], 0.0, "bfloat16")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_generate_cli_refuses_a_bad_temperature_before_loading_models(tmp_path, capsys, value):
    """The target does not exist: had the models been loaded first, the error would name the file."""
    with pytest.raises(SystemExit) as caught:
        generate_cli(["--prompt", "hi", "--target", str(tmp_path / "missing"), "--temperature", value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--temperature must be a finite number >= 0" in err and "missing" not in err, err
