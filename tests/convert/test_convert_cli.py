"""`minite convert` as a user meets it, run as a real subprocess: every user error (a bad input, a bad argument, an
--out that holds something) is one line naming the file and what is wrong, exit status 2, and leaves no --out.

One tiny single-file Hugging Face checkpoint (transformers' save_pretrained) and its Megatron conversion serve every
test; each failure is one `minite` process (about two seconds, most of it importing torch)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.test_cli import assert_one_line_failure, minite


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A directory holding hf/ (config.json, model.safetensors, generation_config.json) and mg/, its conversion."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=32, norm_topk_prob=True, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).to(torch.bfloat16).save_pretrained(root / "hf")
    out = minite("convert", "hf-to-megatron", "--hf", "hf", "--out", "mg", "--no-progress", cwd=root)
    assert out.returncode == 0 and out.stdout == "wrote mg\n", out.stderr[-3000:]
    return root


def _copy(ckpt: Path, name: str, dst: Path) -> Path:
    return Path(shutil.copytree(ckpt / name, dst / name))


def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


COMMANDS = [  # each conversion's arguments but --out, from the fixture's checkpoint
    lambda ckpt: ["megatron-to-hf", "--megatron", str(ckpt / "mg"), "--no-progress"],
    lambda ckpt: ["hf-to-megatron", "--hf", str(ckpt / "hf"), "--no-progress"],
    lambda ckpt: ["export-nvfp4", "--hf", str(ckpt / "hf")],
]


def test_user_errors_exit_2_in_one_line(ckpt, tmp_path):
    assert_one_line_failure(minite("convert", "hf-to-megatron", "--hf", "nope", "--out", "o", cwd=tmp_path),
                            r"^minite convert: --hf nope: does not exist$")
    assert not (tmp_path / "o").exists()


def test_export_names_a_tensor_holding_nan(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _copy(ckpt, "hf", tmp_path)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.experts.2.up_proj.weight"][0, 3] = float("nan")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    out = minite("convert", "export-nvfp4", "--hf", "hf", "--out", "o", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite convert: tensor 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight' in hf "
                                 r"holds NaN or Inf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no --out, no staging directory


def _poison(path: Path, name: str) -> None:
    """One element of tensor `name` in safetensors file `path` set to NaN."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def test_every_conversion_names_a_tensor_holding_nan_and_writes_nothing(ckpt, tmp_path):
    """A NaN in the source stops hf-to-megatron, megatron-to-hf and export-nvfp4 --megatron before anything lands in
    --out, naming the source tensor, its file and what it was read for; a TP replica (a norm every TP rank holds a
    copy of, never read back) too."""
    from minite.convert.hf_megatron import dense_file, hf_to_megatron

    hf, mg = _copy(ckpt, "hf", tmp_path), _copy(ckpt, "mg", tmp_path)
    hf_to_megatron(ckpt / "hf", tmp_path / "tp2", tp=2, progress=False)
    _poison(hf / "model.safetensors", "model.layers.1.self_attn.o_proj.weight")
    out = minite("convert", "hf-to-megatron", "--hf", "hf", "--out", "o", "--no-progress", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite convert: tensor 'model\.layers\.1\.self_attn\.o_proj\.weight' in "
                                 r"\S*hf/model\.safetensors holds NaN or Inf, read for "
                                 r"'decoder\.layers\.1\.self_attention\.linear_proj\.weight': not weights")
    experts = next(p.name for p in sorted(mg.glob("*.safetensors")) if "expert" in p.name)
    _poison(mg / experts, "decoder.layers.0.mlp.experts.fc2_weight")
    for command in (["megatron-to-hf", "--megatron", "mg", "--no-progress"], ["export-nvfp4", "--megatron", "mg"]):
        out = minite("convert", *command, "--out", "o", cwd=tmp_path)
        assert_one_line_failure(out, rf"^minite convert: tensor 'decoder\.layers\.0\.mlp\.experts\.fc2_weight' in "
                                     rf"\S*mg/{experts} holds NaN or Inf, read for "
                                     r"'model\.layers\.0\.mlp\.experts\.\d+\.down_proj\.weight'")
    _poison(tmp_path / "tp2" / dense_file(1, 0), "decoder.layers.0.input_layernorm.weight")
    for command in (["megatron-to-hf", "--megatron", "tp2", "--no-progress"], ["export-nvfp4", "--megatron", "tp2"]):
        out = minite("convert", *command, "--out", "o", cwd=tmp_path)
        assert_one_line_failure(out, r"^minite convert: tensor 'decoder\.layers\.0\.input_layernorm\.weight' in "
                                     rf"\S*tp2/{dense_file(1, 0)} holds NaN or Inf: not weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mg", "tp2"]  # no --out, no staging directory


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_export_from_megatron_writes_no_hugging_face_copy(ckpt, tmp_path, monkeypatch, tp, ep):
    """export-nvfp4 --megatron reads the Megatron shards directly: no temporary directory (a 30B model's Hugging Face
    copy would be 60 GB there) and no HF conversion; the output equals the export from the HF source, file by file,
    for a TP and EP split too. A 64 MiB file beside the weights (a .bin twin, say), which hf-to-megatron keeps, is
    copied by neither export."""
    import tempfile

    from minite.convert import export_nvfp4
    from minite.convert.hf_megatron import hf_to_megatron

    def refused(*args, **kwargs):
        raise AssertionError("export-nvfp4 --megatron made a temporary copy")

    hf = _copy(ckpt, "hf", tmp_path)
    with open(hf / "pytorch_model.bin", "wb") as f:
        f.truncate(64 * 1024 ** 2)  # sparse
    mg = hf_to_megatron(hf, tmp_path / "mg", tp=tp, ep=ep, progress=False)
    assert (mg / "pytorch_model.bin").is_file()
    b = export_nvfp4.export_nvfp4(hf_dir=hf, out_dir=tmp_path / "b")
    for module, name in ((tempfile, "mkdtemp"), (tempfile, "TemporaryDirectory"), (export_nvfp4, "megatron_to_hf")):
        monkeypatch.setattr(module, name, refused, raising=False)
    a = export_nvfp4.export_nvfp4(megatron_dir=mg, out_dir=tmp_path / "a")
    assert _tree(a) == _tree(b) and not (a / "pytorch_model.bin").exists()


def test_out_holding_anything_is_refused_and_left_as_it_was(ckpt, tmp_path):
    """A single-file HF checkpoint (no index) as megatron-to-hf's --out; any config.json as hf-to-megatron's."""
    taken = _copy(ckpt, "hf", tmp_path)
    before = _tree(taken)
    for args in COMMANDS:
        out = minite("convert", *args(ckpt), "--out", "hf", cwd=tmp_path)
        assert_one_line_failure(out, r"^minite convert: --out hf: directory not empty \('config\.json'\), refusing to "
                                     r"write over it")
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / "config.json").write_text("{}")
    out = minite("convert", "hf-to-megatron", "--hf", str(ckpt / "hf"), "--out", "lone", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite convert: --out lone: directory not empty")
    assert _tree(taken) == before and (tmp_path / "lone" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "lone"]


def test_out_naming_a_file_is_refused(ckpt, tmp_path):
    (tmp_path / "f").write_text("x")
    for args in COMMANDS:
        assert_one_line_failure(minite("convert", *args(ckpt), "--out", "f", cwd=tmp_path),
                                r"^minite convert: --out f: exists and is not a directory")
    assert (tmp_path / "f").read_text() == "x"


def test_an_empty_out_directory_receives_the_conversion_and_stays_itself(ckpt, tmp_path):
    """`--out .` from an empty directory: the files land in that directory (same inode: the shell's current
    directory, or a mount point, is not replaced)."""
    (tmp_path / "o").mkdir()
    inode = (tmp_path / "o").stat().st_ino
    out = minite("convert", "megatron-to-hf", "--megatron", str(ckpt / "mg"), "--out", ".", "--no-progress",
                 cwd=tmp_path / "o")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "o").stat().st_ino == inode
    files = _tree(tmp_path / "o")
    assert files["model.safetensors"] == (ckpt / "hf" / "model.safetensors").read_bytes()
    assert sorted(files) == ["config.json", "generation_config.json", "model.safetensors",
                             "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_a_missing_small_file_fails_before_anything_is_written(ckpt, tmp_path):
    mg = _copy(ckpt, "mg", tmp_path)
    (mg / "config.json").unlink()
    out = minite("convert", "megatron-to-hf", "--megatron", "mg", "--out", "o", "--no-progress", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite convert: mg/config\.json: not found \(mg/minite_checkpoint\.json lists it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


@pytest.mark.parametrize("direction", ["hf_to_megatron", "megatron_to_hf"])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("exists", [False, True])
def test_a_run_stopped_midway_leaves_no_out_and_no_staging(ckpt, tmp_path, monkeypatch, direction, stop, exists):
    """Ctrl-C or a failure after the weight files are written: --out never appears (or stays empty), and the
    staging directory goes."""
    from minite.convert import hf_megatron

    def interrupted(*args, **kwargs):
        assert any(tmp_path.glob("o/.minite-convert.tmp-*/*.safetensors" if exists else ".o.tmp-*/*.safetensors"))
        raise stop("stopped")

    if exists:
        (tmp_path / "o").mkdir()
    monkeypatch.setattr(hf_megatron, "_copy_small_files", interrupted)
    monkeypatch.setattr(hf_megatron.shutil, "copyfile", interrupted)
    src = ckpt / ("hf" if direction == "hf_to_megatron" else "mg")
    with pytest.raises(stop):
        getattr(hf_megatron, direction)(src, tmp_path / "o", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == (["o"] if exists else [])
    assert not exists or list((tmp_path / "o").iterdir()) == []


def test_an_interrupted_move_into_an_empty_out_takes_back_the_files_moved(tmp_path, monkeypatch):
    from minite.convert import files

    (tmp_path / "o").mkdir()
    real_replace, calls = files.os.replace, []

    def replace_then_stop(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace_then_stop)
    with pytest.raises(KeyboardInterrupt):
        with files.staged_output(tmp_path / "o") as stage:
            for name in ("a", "b", "c"):
                (stage / name).write_text(name)
    assert len(calls) == 2 and list((tmp_path / "o").iterdir()) == []


def _edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _edit_header(path: Path, fn) -> None:
    """Rewrite a safetensors file's JSON header through fn, the tensor bytes unchanged."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.dumps(fn(json.loads(raw[8:8 + n]))).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])


def _drop_offsets(header: dict) -> dict:
    del header["model.norm.weight"]["data_offsets"]
    return header


def _index(hf: Path, text: str) -> None:
    (hf / "model.safetensors.index.json").write_text(text)


HF_CASES = {  # damage to a copy of hf/, the command, the one line expected after "minite convert: "
    "config not JSON": (lambda hf: (hf / "config.json").write_text("{"), "hf-to-megatron",
                        r"hf/config\.json: not readable as JSON \(Expecting property name"),
    "config a list": (lambda hf: (hf / "config.json").write_text("[]"), "hf-to-megatron",
                      r"hf/config\.json: expected a JSON object, found list$"),
    "config a string size": (lambda hf: _edit_json(hf / "config.json", lambda c: {**c, "hidden_size": "64"}),
                             "hf-to-megatron", r"hf/config\.json: hidden_size = '64', expected an integer >= 1$"),
    "config of another model": (lambda hf: _edit_json(hf / "config.json", lambda c: {**c, "model_type": "llama"}),
                                "hf-to-megatron", r"hf/config\.json: model_type 'llama'; only Qwen3-MoE \(qwen3_moe\)"),
    "index not JSON": (lambda hf: _index(hf, "{"), "hf-to-megatron",
                       r"hf/model\.safetensors\.index\.json: not readable as JSON"),
    "index a list": (lambda hf: _index(hf, "[]"), "hf-to-megatron",
                     r"hf/model\.safetensors\.index\.json: expected a JSON object, found list$"),
    "index without weight_map": (lambda hf: _index(hf, '{"metadata": {}}'), "hf-to-megatron",
                                 r"hf/model\.safetensors\.index\.json: no weight_map"),
    "header entry without offsets": (lambda hf: _edit_header(hf / "model.safetensors", _drop_offsets),
                                     "hf-to-megatron", r"hf/model\.safetensors: tensor 'model\.norm\.weight': "
                                                       r"data_offsets None is not \[begin, end\]$"),
    "export: truncated shard": (lambda hf: (hf / "model.safetensors").write_bytes(
        (hf / "model.safetensors").read_bytes()[:-10]), "export-nvfp4", r"hf/model\.safetensors: truncated file: "),
    "export: config not JSON": (lambda hf: (hf / "config.json").write_text("{"), "export-nvfp4",
                                r"hf/config\.json: not readable as JSON"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_a_malformed_hugging_face_input_is_one_line(ckpt, tmp_path, case):
    damage, command, pattern = HF_CASES[case]
    damage(_copy(ckpt, "hf", tmp_path))
    out = minite("convert", command, "--hf", "hf", "--out", "o", cwd=tmp_path)
    assert_one_line_failure(out, "^minite convert: " + pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


MG_CASES = {  # damage to a copy of mg/, the one line expected after "minite convert: "
    "metadata not JSON": (lambda mg: (mg / "minite_checkpoint.json").write_text("{"),
                          r"mg/minite_checkpoint\.json: not readable as JSON"),
    "metadata without tp": (lambda mg: _edit_json(mg / "minite_checkpoint.json", lambda m: {**m, "tp": None}),
                            r"mg/minite_checkpoint\.json: tp = None, expected an integer >= 1$"),
    "metadata without hf_config": (lambda mg: _edit_json(mg / "minite_checkpoint.json",
                                                         lambda m: {k: v for k, v in m.items() if k != "hf_config"}),
                                   r"mg/minite_checkpoint\.json: hf_config: expected a JSON object, found NoneType$"),
    "metadata naming a path": (lambda mg: _edit_json(mg / "minite_checkpoint.json",
                                                     lambda m: {**m, "hf_files": ["../config.json"]}),
                               r"mg/minite_checkpoint\.json: hf_files: '\.\./config\.json' is not a file name$"),
    "header not an object": (lambda mg: _edit_header(mg / "experts_pp000_ep000.safetensors", lambda h: [h]),
                             r"mg/experts_pp000_ep000\.safetensors: unreadable safetensors header: a JSON list"),
}


@pytest.mark.parametrize("case", MG_CASES)
def test_a_malformed_megatron_input_is_one_line(ckpt, tmp_path, case):
    damage, pattern = MG_CASES[case]
    damage(_copy(ckpt, "mg", tmp_path))
    out = minite("convert", "megatron-to-hf", "--megatron", "mg", "--out", "o", cwd=tmp_path)
    assert_one_line_failure(out, "^minite convert: " + pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


@pytest.mark.parametrize("args,pattern", [
    (["--ep", "0"], r"--ep 0: must be >= 1$"),
    (["--tp", "-1"], r"--tp -1: must be >= 1$"),
    (["--tp", "3"], r"--tp 3 does not divide the model's num_key_value_heads 2$"),
])
def test_a_bad_parallel_size_is_one_line(ckpt, tmp_path, args, pattern):
    out = minite("convert", "hf-to-megatron", "--hf", str(ckpt / "hf"), "--out", "o", *args, cwd=tmp_path)
    assert_one_line_failure(out, "^minite convert: " + pattern)
    assert list(tmp_path.iterdir()) == []


def test_an_input_that_is_not_a_directory_is_one_line(ckpt, tmp_path):
    config = re.escape(str(ckpt / "hf" / "config.json"))
    for command, option in (("hf-to-megatron", "--hf"), ("export-nvfp4", "--hf"), ("megatron-to-hf", "--megatron")):
        out = minite("convert", command, option, str(ckpt / "hf" / "config.json"), "--out", "o", cwd=tmp_path)
        assert_one_line_failure(out, rf"^minite convert: {option} {config}: not a directory \({option} names a ")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_input_scale_that_is_no_decode_scale(ckpt, tmp_path):
    """input_scale divides the activations' block amax in an engine: NaN, 0, negative or inf in float32 are refused."""
    for value in ("nan", "0", "-1", "1e39"):
        out = minite("convert", "export-nvfp4", "--hf", str(ckpt / "hf"), "--out", "o", "--input-scale", value,
                     cwd=tmp_path)
        shown = re.escape(str(float(value)))
        assert_one_line_failure(out, rf"^minite convert: --input-scale {shown}: must be a finite number > 0")
    assert list(tmp_path.iterdir()) == []


def test_export_reads_transformers5_fused_experts(ckpt, tmp_path):
    """The export's input check accepts each layer's experts as gate_up_proj [E, 2F, H] and down_proj [E, H, F]:
    the same export as from the per-expert tensors."""
    from safetensors.torch import load_file, save_file

    from minite.convert.export_nvfp4 import export_nvfp4

    hf = _copy(ckpt, "hf", tmp_path)
    tensors = load_file(hf / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        per = [[tensors.pop(f"{p}{e}.{n}_proj.weight") for n in ("gate", "up", "down")] for e in range(4)]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in per])
        tensors[p + "down_proj"] = torch.stack([down for _, _, down in per])
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    fused = _tree(export_nvfp4(hf_dir=hf, out_dir=tmp_path / "fused"))
    assert fused == _tree(export_nvfp4(hf_dir=ckpt / "hf", out_dir=tmp_path / "per-expert"))


def _stage(d: Path, locked: bool = False):
    """A staging directory as a conversion leaves it: a partial file and the lock file, flocked (a conversion running:
    the open file returned) or not (its process killed)."""
    import fcntl
    import os

    (d / "sub").mkdir(parents=True)
    (d / "sub" / "model.safetensors").write_bytes(b"partial")
    fd = os.open(d / ".minite-convert.lock", os.O_RDWR | os.O_CREAT)
    if locked:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd
    os.close(fd)


def _host() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:32]


@pytest.mark.parametrize("exists", [False, True])
def test_a_killed_conversions_staging_directory_goes_with_the_next_conversion(ckpt, tmp_path, exists):
    """SIGKILL leaves the staging directory (no handler runs, the kernel drops the process's flock): the next
    conversion into the same --out removes it, naming it, when it was made on this host and its lock is free. Kept:
    another host's, a locked one (a conversion running, maybe in another PID namespace), one without its lock file.
    Inside an empty --out (exists) it would otherwise make --out non-empty and refuse the rerun."""
    import os

    place, name = (tmp_path / "o", ".minite-convert") if exists else (tmp_path, ".o")
    stale = place / f"{name}.tmp-{_host()}-123-0123abcd"
    _stage(stale)
    kept, held = [], None
    if not exists:
        kept = [place / f"{name}.tmp-elsewhere-123-0123abcd", place / f"{name}.tmp-{_host()}-124-0123abcd",
                place / f"{name}.tmp-{_host()}-125-0123abcd"]
        _stage(kept[0])
        held = _stage(kept[1], locked=True)
        _stage(kept[2])
        (kept[2] / ".minite-convert.lock").unlink()
    try:
        out = minite("convert", "export-nvfp4", "--hf", str(ckpt / "hf"), "--out", "o", cwd=tmp_path)
    finally:
        if held is not None:
            os.close(held)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"removed {stale}: the staging directory of a conversion into o that was killed" in out.stderr
    assert not stale.exists() and all(d.exists() for d in kept)
    assert not [p.name for p in (tmp_path / "o").iterdir() if p.name.startswith(".")]  # no lock file, no stage
    assert (tmp_path / "o" / "hf_quant_config.json").is_file()


def test_a_running_conversions_staging_directory_is_named_in_the_refusal(ckpt, tmp_path):
    """An empty --out holding a staging directory still locked (a conversion into it is running): refused, naming
    the hidden entry (which `ls` does not show) and what it is; left as it is."""
    import os

    stage = tmp_path / "o" / f".minite-convert.tmp-{_host()}-123-0123abcd"
    held = _stage(stage, locked=True)
    try:
        out = minite("convert", "export-nvfp4", "--hf", str(ckpt / "hf"), "--out", "o", cwd=tmp_path)
    finally:
        os.close(held)
    assert_one_line_failure(out, rf"^minite convert: --out o: directory not empty \('{re.escape(stage.name)}', the "
                                 r"staging directory of a conversion into it that is running or ran on another host: "
                                 r"delete it if none is\), refusing to write over it")
    assert stage.is_dir()
