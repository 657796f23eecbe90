"""The `minite` command as a user meets it, run as a real subprocess: one-line failures with exit status 2 (130 for
Ctrl-C) and no traceback unless --debug, the quiet header/summary output, the resume policy, the flags.

Runs are tiny (2 prompts x 2 samples, 1-2 RL steps, no warm-up) so the file stays fast on a 2-core machine."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from minite.bench_cli import DEFAULT_OUT, driver_arguments
from minite.convert.hf_megatron import FORMAT as MG_FORMAT, META_FILE

REPO = Path(__file__).resolve().parents[2]
MINITE = str(Path(sys.executable).parent / "minite")
TINY = ["rl.prompts_per_step=2", "rollout.group_size=2", "rl.warmup_steps=0", "rl.minibatches=1",
        "model.max_position_embeddings=16", "checkpoint.every=1"]


def minite(*args, cwd, env=None, timeout=300, preexec_fn=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("MINITE_DEBUG", "PYTHONWARNINGS")}
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([MINITE, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)


def tiny_config(tmp_path, **sections) -> Path:
    """examples/tiny/nvfp4.yaml with the run directories under tmp_path (relative: they resolve from the YAML)."""
    data = yaml.safe_load((REPO / "examples/tiny/nvfp4.yaml").read_text())
    data["logging"] = {"dir": "run", "progress_bar": False}
    data["checkpoint"] = {"dir": "run/ck", "every": 1}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def assert_one_line_failure(out, pattern: str, status: int = 2) -> None:
    assert out.returncode == status, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("args,pattern", [
    (["--set", "rl.steps=five"], r"^minite train: --set rl.steps=five: expected int, got str 'five'$"),
    (["--set", "model.hidden_size=40"], r"^minite train: .*tiny.yaml: model hidden_size = 40 is not a multiple of 16"),
    (["--set", "parallel.ep=2"], r"^minite train: parallel.tp=1 x parallel.pp=1 and parallel.ep=2 must divide the 1 "),
    (["--set", "parallel.tp=2", "--set", "parallel.ep=2"],
     r"^minite train: .*tiny.yaml: parallel: tp=2 with ep=2: tensor and expert parallelism together are not supported"),
    (["--set", "parallel.ep=2", "--set", "rollout.backend=sglang"],
     r"^minite train: .*tiny.yaml: rollout.backend=sglang takes weight updates from a learner with parallel.tp"),
    (["--set", "optim.clip_grad=-1"], r"^minite train: .*tiny.yaml: optim: clip_grad must be >= 0"),
    (["--set", "optim.adam_beta2=1.5"], r"^minite train: .*tiny.yaml: optim: adam_beta2 must be in \[0, 1\), got 1.5"),
    (["--set", "optim.adam_eps=0"], r"^minite train: .*tiny.yaml: optim: adam_eps must be > 0, got 0"),
    (["--set", "model.rope_theta=0"], r"^minite train: .*tiny.yaml: model: rope_theta must be > 0, got 0"),
    (["--set", "precision.params_dtype=bfloat16"],
     r"^minite train: .*tiny.yaml: precision: params_dtype='bfloat16' is not"),
    (["--set", "parallel.pp=2"], r"^minite train: .*tiny.yaml: parallel: pp=2: pipeline parallelism is not supported"),
    (["--set", "model.hf_config=nope.json"], r"^minite train: model.hf_config: nope.json does not exist"),
    (["--set", "rollout.max_new_tokens=40"], r"^minite train: .*tiny.yaml: prompt .* exceeds model.max_position"),
    (["--set", "rl.micro_batches=3"], r"^minite train: .*rl.micro_batches=3 does not divide the rows of a train step"),
    (["--set", "rl.is_threshold=.nan"],
     r"^minite train: --set rl.is_threshold=.nan: expected a finite number, got nan$"),
    (["--set", "model.rope_theta=.inf"],
     r"^minite train: --set model.rope_theta=.inf: expected a finite number, got inf$"),
    (["--set", "model.moe_router_topk=1", "--set", "rl.steps=3"],
     r"^minite train: .*tiny.yaml: model.moe_router_topk=1 with model.norm_topk_prob=true .*: set "
     r"model.norm_topk_prob=false .*\(with --set model.moe_router_topk=1\)$"),
    (["--set", "model.shared_expert_intermediate_size=-16"],
     r"^minite train: .*tiny.yaml: model: shared_expert_intermediate_size must be >= 0 \(0: no shared expert\), got "
     r"-16 \(with --set model.shared_expert_intermediate_size=-16\)$"),
    (["--set", "logging.dir=tiny.yaml"], r"^minite train: logging.dir: tiny.yaml is a file, not a directory"),
])
def test_config_failures_are_one_line(tmp_path, args, pattern):
    assert_one_line_failure(minite("train", str(tiny_config(tmp_path)), *args, cwd=tmp_path), pattern)


def test_a_directory_as_config_in_both_forms(tmp_path):
    assert_one_line_failure(minite("train", "--config", str(tmp_path), cwd=tmp_path),
                            rf"^minite train: {tmp_path} is a directory: give a YAML file")
    assert_one_line_failure(minite("diagnose", str(tmp_path), cwd=tmp_path),
                            rf"^minite diagnose: {tmp_path} is a directory")
    assert_one_line_failure(minite("diagnose", "a.yaml", "--config", "b.yaml", cwd=tmp_path),
                            r"^minite diagnose: two configs given \(a.yaml and --config b.yaml\): give one$")


def test_unreadable_config_files_are_one_line(tmp_path):
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    assert_one_line_failure(minite("train", "binary.yaml", cwd=tmp_path),
                            r"^minite train: binary.yaml: not a text file \(byte 128 is not UTF-8\): give a YAML file")
    (tmp_path / "dup.yaml").write_text("rl:\n  steps: 3\n  steps: 4\n")
    assert_one_line_failure(minite("train", "dup.yaml", cwd=tmp_path),
                            r"^minite train: dup.yaml: key 'steps' is given twice \(lines 2 and 3\): keep one$")


def test_debug_shows_the_traceback(tmp_path):
    for out in (minite("train", str(tmp_path), "--debug", cwd=tmp_path),
                minite("--debug", "train", str(tmp_path), cwd=tmp_path),
                minite("train", str(tmp_path), cwd=tmp_path, env={"MINITE_DEBUG": "1"})):
        assert out.returncode == 2 and "Traceback" in out.stderr and "ConfigError" in out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith("minite train: ")


def test_init_from_for_another_layout(tmp_path):
    mg = tmp_path / "mg"
    mg.mkdir()
    (mg / META_FILE).write_text(json.dumps({"format": MG_FORMAT, "tp": 1, "ep": 2, "pp": 1}))
    out = minite("train", str(tiny_config(tmp_path, model={"init_from": "mg"})), "--set", "rl.steps=1", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite train: .*mg: written for \(tp, ep, pp\)=\(1, 2, 1\), the model runs "
                                 r"\(1, 1, 1\); convert again with matching --tp/--ep/--pp$")


def test_train_resume_policy_and_output(tmp_path):
    tiny_config(tmp_path)
    cfg = "tiny.yaml"  # relative, so that the run directories print as run/...
    first = minite("train", cfg, *[a for s in TINY for a in ("--set", s)], "--set", "rl.steps=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0].startswith("minite train: Qwen3-MoE 2 layers, hidden 64, 4 experts top-2 | NVFP4 W4A4 | "
                               "rollout embedded | CPU, 1 process | output run (log train.log)")
    assert lines[1].startswith("minite train: done, 1 RL steps in ")
    assert lines[2] == (f"  output: log run/train.log, metrics run/metrics.jsonl, TensorBoard run, "
                        f"checkpoint run/ck/step_000001")
    assert first.stderr == ""  # quiet: no upstream warnings, INFO dumps or "saved checkpoint" lines
    log = (tmp_path / "run" / "train.log").read_text()
    for upstream in ("Transformer Engine and Apex are not installed", "Params for bucket", "saved checkpoint"):
        assert upstream in log

    sets = [a for s in TINY for a in ("--set", s)]
    resumed = minite("train", cfg, *sets, "--set", "rl.steps=2", "--set", "optim.lr=0.01", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.splitlines() == [
        f"resuming from the checkpoint in run/ck at step 1; changed since then: optim.lr 0.002 -> 0.01, "
        f"rl.steps 1 -> 2"]
    assert "done, 1 RL steps" in resumed.stdout

    refused = minite("train", cfg, *sets, "--fresh", "--set", "rl.micro_batches=3", cwd=tmp_path)
    assert_one_line_failure(refused, r"^minite train: .*rl.micro_batches=3 does not divide")
    assert (tmp_path / "run" / "ck" / "step_000002").is_dir()  # --fresh deletes nothing for a run it refuses
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert_one_line_failure(minite("train", cfg, *sets, "--set", "precision.mode=bf16", cwd=tmp_path),
                            r"^minite train: precision.mode is 'nvfp4' in the checkpoint in run/ck but 'bf16' now: "
                            r"a resumed run cannot change the precision; put it back, or start over with --fresh")
    assert_one_line_failure(minite("train", cfg, *sets, "--set", "rl.steps=1", cwd=tmp_path),
                            r"^minite train: the checkpoint in run/ck is at step 2, past rl.steps=1: raise rl.steps "
                            r"to continue it, or start over with `minite train CONFIG --fresh`")

    fresh = minite("train", cfg, *sets, "--set", "rl.steps=1", "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.stderr.startswith("--fresh: removed step_000001, step_000002, metrics.jsonl, events.out.tfevents.")
    assert sorted(p.name for p in (tmp_path / "run" / "ck").iterdir()) == ["step_000001"]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1

    (tmp_path / "run" / "ck" / "step_000001" / "state.pt").write_bytes(b"\xff" * 64)
    assert_one_line_failure(minite("train", cfg, *sets, "--set", "rl.steps=2", cwd=tmp_path),
                            r"^minite train: .*step_000001.* (corrupt|unreadable|checksum)")


def test_a_diverged_run_is_one_line_naming_the_step_and_the_way_back(tmp_path):
    """NaN or Inf during a run (a learning rate of 1e30 without clipping) is a user error, exit status 2: one line
    naming the step and the checkpoint the same command resumes from, no traceback, and no checkpoint of the
    non-finite step."""
    tiny_config(tmp_path)
    sets = [a for s in TINY for a in ("--set", s)]
    first = minite("train", "tiny.yaml", *sets, "--set", "rl.steps=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    blow_up = ["--set", "optim.lr=1e30", "--set", "optim.clip_grad=0"]
    out = minite("train", "tiny.yaml", *sets, *blow_up, "--set", "rl.steps=3", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    resuming, failure = out.stderr.splitlines()
    assert resuming.startswith("resuming from the checkpoint in run/ck at step 1")
    step = re.fullmatch(r"minite train: the run diverged at RL step ([23]) of 3: .*(NaN or Inf|not a finite).*\. "
                        r"Lower optim.lr \(optim.lr=1e\+30, optim.clip_grad=0\) and run the same command again: "
                        r"it resumes from the newest checkpoint, run/ck/step_00000([12]) \(an older one: "
                        r"--set checkpoint.resume_from=DIR --set checkpoint.dir=ANOTHER_DIR --set "
                        r"logging.dir=ANOTHER_DIR; start over: --fresh\)",
                        failure)
    assert step and int(step[3]) == int(step[1]) - 1, failure  # the newest: the step before the one that failed
    assert sorted(p.name for p in (tmp_path / "run" / "ck").iterdir())[-1] == f"step_00000{step[3]}"

    warm = minite("train", "tiny.yaml", *sets, *blow_up, "--set", "rl.warmup_steps=3", "--set", "precision.mode=bf16",
                  "--set", "checkpoint.dir=bf16/ck", "--set", "logging.dir=bf16", cwd=tmp_path)
    assert_one_line_failure(warm, r"^minite train: the run diverged at warm-up step [23] of 3: .*\. Lower optim.lr "
                                  r".* run the same command again: it starts over$")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run would build on the GPU, whose driver reserves more "
                    "address space than the limit (and an H200 holds 64 GiB)")
def test_a_model_too_large_for_memory_is_one_line(tmp_path):
    """A model whose experts alone ask for 64 GiB, under a 16 GiB address-space limit (so that the allocation fails
    at once whatever the machine's overcommit policy): one line naming the size and the fix, exit status 2."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))

    sets = [a for s in TINY + ["model.hidden_size=65536", "model.moe_ffn_hidden_size=65536"] for a in ("--set", s)]
    out = minite("train", str(tiny_config(tmp_path)), *sets, cwd=tmp_path, preexec_fn=limit)
    assert_one_line_failure(out, r"^minite train: out of memory while building the run \(an allocation of 64\.0 GiB "
                                 r"on the CPU\): the model does not fit: shrink it \(model\.\*\) or spread it over "
                                 r"more ranks \(parallel\.ep, parallel\.tp\)$")


def test_train_with_micro_batches(tmp_path):
    """Gradient accumulation from the command line: the NVFP4 tiny job's rows in two chunks per train step."""
    tiny_config(tmp_path)
    sets = [a for s in TINY for a in ("--set", s)]
    out = minite("train", "tiny.yaml", *sets, "--set", "rl.steps=1", "--set", "rl.micro_batches=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done, 1 RL steps" in out.stdout and out.stderr == ""
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["step_ok"] == 1.0 and step["grad_norm"] == step["grad_norm"]  # the optimizer step ran, finite


def test_ctrl_c_is_one_line_and_status_130(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([MINITE, "train", str(tiny_config(tmp_path)), *[a for s in TINY for a in ("--set", s)],
                             "--set", "rl.steps=50"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    header = proc.stdout.readline()  # printed once the config is checked: the run is under way
    assert header.startswith("minite train: Qwen3-MoE"), header
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines() == ["minite train: interrupted (Ctrl-C); run the same command again to resume "
                                        "from the newest checkpoint"]


def test_sglang_that_cannot_be_imported_is_one_line(tmp_path):
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import sgl_kernel_missing_for_this_test\n")
    out = minite("train", str(tiny_config(tmp_path)), "--set", "rl.steps=1", "--set", "rollout.backend=sglang",
                 cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "fake")})
    assert_one_line_failure(out, r"^minite train: rollout.backend=sglang cannot import sglang \(No module named "
                                 r"'sgl_kernel_missing_for_this_test'\): install it with `bash tools/setup.sh`")


def test_flags(tmp_path):
    out = minite("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "minite 0.1.0"
    out = minite("bench", "--sections", "quant,decode", cwd=tmp_path)  # the example of its own --help
    assert "unrecognized arguments" not in out.stderr
    if out.returncode == 2:  # no GPU here: the one-line reason, not an argument error
        assert_one_line_failure(out, r"^minite bench: the kernel benchmarks need a CUDA GPU")
    help_text = minite("diagnose", "--help", cwd=tmp_path).stdout
    for flag in ("--max-new-tokens", "--seed"):
        assert re.search(rf"{flag} [A-Z_]+\s+[a-z]", help_text), flag  # a metavar, then help text (not "--next")
    out = minite("train", "--fresh", "--set", "rl.steps=1", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite train: no config given: name a YAML file")


def test_bench_out_never_defaults_to_the_tracked_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, out = driver_arguments(["--sections", "quant,decode"])
    assert argv == ["--sections", "quant,decode", "--out", str(tmp_path / DEFAULT_OUT)]
    assert out == tmp_path / DEFAULT_OUT
    argv, out = driver_arguments(["--out", "x.json"])
    assert argv == ["--out", str(tmp_path / "x.json")]
    argv, out = driver_arguments(["--out=y.json"])
    assert argv == [f"--out={tmp_path / 'y.json'}"] and out == tmp_path / "y.json"


def test_train_from_a_converted_checkpoint(tmp_path):
    """The README's recipe: convert a Hugging Face checkpoint, name it as model.init_from; one line confirms it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=32, norm_topk_prob=True, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    out = minite("convert", "hf-to-megatron", "--hf", "hf", "--out", "mg", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    tiny_config(tmp_path)
    sets = [a for s in TINY + ["rl.steps=1", "model.hf_config=hf/config.json", "model.init_from=mg"]
            for a in ("--set", s)]
    out = minite("train", "tiny.yaml", *sets, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("minite train: Qwen3-MoE from hf/config.json | NVFP4 W4A4 |")
    assert out.stderr.splitlines() == ["initial weights loaded from mg"]

    from safetensors.torch import load_file, save_file  # one NaN in the converted weights: named before any step
    part = sorted((tmp_path / "mg").glob("*.safetensors"))[0]
    tensors = load_file(part)
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[0]
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, part, metadata={"format": "pt"})
    again = ["--set", "checkpoint.dir=nan/ck", "--set", "logging.dir=nan"]
    assert_one_line_failure(minite("train", "tiny.yaml", *sets, *again, cwd=tmp_path),
                            rf"^minite train: tensor '{re.escape(name)}' in .*{part.name} holds NaN or Inf: not "
                            r"weights to start a run from")

