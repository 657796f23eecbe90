"""Configuration: nested kw_only dataclasses that map one to one onto YAML files.

A YAML file is a mapping of section -> mapping of field -> value, mirroring `Config`. Loading is strict
(minite.typed_yaml, which also defines `ConfigError` and `from_dict`): an unknown key, a key given twice, a value of the
wrong type or a NaN or Inf in a float field is a `ConfigError` naming the file and the key (`FILE: section.key: ...`);
each dataclass checks its own values in __post_init__ (`FILE: section: ...`, followed by the `--set` items of the keys
the message names). Command-line overrides (`--set rl.steps=5`) are parsed as YAML scalars and go through the same
checks; an error in one names the `--set` item, not the file.

Paths (PATH_FIELDS), one rule: a relative path resolves from where it was written. Written in the YAML file, it is
relative to that file's directory (a config and the files it names move together); given with --set, or left at its
default, it is relative to the current directory (like any command-line path).

Shape constraints are checked at load time (`check_model_shape`): NVFP4 quantises weights in 16x16 blocks, so every
dimension a quantised GEMM sees is a multiple of 16, and tensor/expert parallelism must split heads and experts evenly.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from minite.nvfp4.recipe import NVFP4Recipe
from minite.typed_yaml import ConfigError, check_key, from_dict, load_yaml

PATH_FIELDS = (("model", "hf_config"), ("model", "init_from"), ("checkpoint", "dir"), ("checkpoint", "resume_from"),
               ("logging", "dir"))


def _at_least(obj, low: int, *names: str) -> None:
    """ValueError naming the first of `names` whose value on `obj` is below `low`."""
    for name in names:
        if getattr(obj, name) < low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(obj, name)}")


@dataclass(kw_only=True)
class ModelConfig:
    """A Qwen3-MoE-shaped model: from a Hugging Face config.json or from the fields below."""

    hf_config: str | None = None
    """Path to a Hugging Face Qwen3-MoE config.json (relative to the YAML file, module docstring); overrides the
    shape fields."""
    init_from: str | None = None
    """Initial weights: a directory written by `minite convert hf-to-megatron` for this run's TP/EP/PP layout
    (relative to the YAML file, module docstring). None: random initialisation from rl.seed."""
    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Key/value heads (GQA)."""
    head_dim: int = 16
    moe_ffn_hidden_size: int = 32
    """Each routed expert's intermediate size (HF moe_intermediate_size)."""
    num_experts: int = 4
    moe_router_topk: int = 2
    shared_expert_intermediate_size: int = 0
    """0: no shared expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one (Qwen3-MoE does)."""
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 256

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "head_dim", "moe_ffn_hidden_size", "num_experts", "moe_router_topk", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be >= 0 (0: no shared expert), got "
                             f"{self.shared_expert_intermediate_size}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be a multiple of num_query_groups")
        if self.moe_router_topk > self.num_experts:
            raise ValueError("moe_router_topk must be <= num_experts")
        if not self.rope_theta > 0:  # 0 or less gives NaN rotary angles at the first forward
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps >= 0:  # a negative epsilon gives NaN norms where a row's mean square is below it
            raise ValueError(f"rms_norm_eps must be >= 0, got {self.rms_norm_eps}")


@dataclass(kw_only=True)
class PrecisionConfig:
    """Number formats of the learner's (and rollout's) GEMMs."""

    mode: Literal["bf16", "nvfp4"] = "nvfp4"
    """bf16: every GEMM in BF16; nvfp4: W4A4 per `recipe` (modules listed in recipe.bf16_modules stay BF16)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weights and optimizer state."""
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Activations between layers and the BF16 GEMMs."""
    recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)

    def __post_init__(self):
        if self.params_dtype == "bfloat16":
            raise ValueError("params_dtype='bfloat16' is not supported: Megatron's optimizer keeps fp32 master weights "
                             "for BF16 compute (use params_dtype='float32')")


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    ep: int = 1
    """Expert-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""

    def __post_init__(self):
        for name in ("tp", "ep", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.pp != 1:
            raise ValueError(f"pp={self.pp}: pipeline parallelism is not supported (use 1; tp or ep split the model)")
        if self.tp > 1 and self.ep > 1:
            raise ValueError(f"tp={self.tp} with ep={self.ep}: tensor and expert parallelism together are not supported "
                             "yet (untested); use one of them")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""

    def __post_init__(self):
        # checked here rather than by torch's Adam, whose refusals came after start-up as unexpected errors
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:  # 0 divides 0 by 0 for a parameter whose gradient is 0
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps}")
        if not self.clip_grad >= 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables it), got {self.clip_grad}")


@dataclass(kw_only=True)
class RolloutConfig:
    backend: Literal["embedded", "sglang"] = "embedded"
    """embedded: Megatron-Core's inference engine in-process; sglang: an SGLang engine with the minite plugin."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    group_size: int = 8
    """Samples per prompt (the GRPO group)."""
    cuda_graphs: bool = True
    """embedded backend on a GPU: replay each decode step as a CUDA graph, captured in the first rollout of a shape
    (minite/rollout/decode.py); off, or a capture that fails, runs the step eagerly (the same bits). With
    alignment.routing_replay the engine records its routes with Python hooks, so every step runs eagerly then."""
    packed_weights: bool = True
    """embedded backend, NVFP4 on a GPU: the expert GEMMs read the weights' packed codes, also kept in the decode
    kernel's order (0.56 B per element), instead of fp16 block values (2 B): the same bits, a quarter of the bytes.
    The dense linears whose K is a multiple of 128 are packed too ("dense_packed", proven on an H100 on 2026-12-07:
    the same step time, ~1.0 B a weight held instead of ~2.5). On the H200 (2026-12-01, 8cadb07, experts only) the
    rollout slice's decode step took 3.26 vs 3.57 ms at batch 64, 5.87 vs 6.16 at 256, 1.65 vs 1.64 at 1
    (docs/benchmarks.md)."""
    stop_check_every: int = 8
    """embedded backend (miniTE's loop): every this many decode steps, one host read of which responses have ended
    (their stop token, the task's end of sequence); once all have, the rollout stops, and until then the unfinished
    ones run at the smallest power-of-two batch that holds them (minite/rollout/decode.py: a finished response stops
    costing; in strict mode every token and log-prob is the full batch's; with CUDA graphs only the stop, until the
    compaction is proven there). 0: never look, run every response to max_new_tokens."""
    sampler: Literal["gumbel", "megatron"] = "gumbel"
    """embedded backend (miniTE's loop), how a token is drawn from softmax(logits / temperature). gumbel: one pass over
    each step's logits, Gumbel-max with a counter-based Philox stream keyed from the rollout's seed (on a GPU two
    Triton launches; minite/rollout/sampling.py). megatron: Megatron-Core's ops (softmax, an exponential draw,
    argmax: ~10 passes over [batch, vocab]), the tokens its controller samples for a seed. The same distribution
    (gumbel's noise reaches further into the tail: ~22 nats below the best token, Megatron's ~16.6), other tokens
    for a seed. With top_p < 1 both run Megatron's nucleus ops."""
    sglang_args: dict[str, Any] = field(default_factory=dict)
    """sglang backend: more `sglang.Engine` keyword arguments, over miniTE's defaults (minite.rollout.sglang.engine
    `engine_args_for`), e.g. --set 'rollout.sglang_args={attention_backend: triton, mem_fraction_static: 0.3}'."""

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _at_least(self, 1, "max_new_tokens", "group_size")
        if self.stop_check_every < 0:
            raise ValueError(f"stop_check_every must be >= 0 (0: never look for stop tokens), got "
                             f"{self.stop_check_every}")


@dataclass(kw_only=True)
class RLConfig:
    steps: int = 50
    prompts_per_step: int = 8
    task: str = "reverse"
    """A task with a verifiable reward (minite.rl.tasks)."""
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    """Weight of the K3 KL to the reference (initial) policy; 0 disables it."""
    is_correction: Literal["none", "tis", "mis"] = "none"
    """Train/rollout mismatch correction: truncated or masked importance sampling."""
    is_threshold: float = 2.0
    seed: int = 0
    task_length: int = 3
    """Digits per problem of the task."""
    task_digits: int = 10
    """Digits are drawn from 0..task_digits-1 (2..10)."""
    warmup_steps: int = 0
    """Supervised steps on correct answers before RL starts (0: none; not part of rl.steps)."""
    minibatches: int = 1
    """Optimizer steps per RL step: the rollout batch is split into this many minibatches (>1 makes PPO clipping act)."""
    micro_batches: int = 1
    """Gradient accumulation: each minibatch (and each warm-up batch) goes through the learner in this many
    consecutive chunks of rows, forward and backward one chunk at a time (only one chunk's activations alive), then
    one optimizer step; the loss is the whole minibatch's token mean either way (each chunk adds its token sum over
    the minibatch's tokens), up to the rounding of the accumulated gradients. Each minibatch's rows must split into
    this many chunks, each a multiple of the data-parallel size. NVFP4 on the kernels: the experts' weight gradients
    wait and are added a few chunks at a time (`NVFP4Context.expert_wgrad_passes`, docs/design.md). Not with
    alignment.routing_replay (its routes are installed per forward of a whole minibatch)."""
    old_logp_source: Literal["learner", "rollout"] = "learner"
    """Denominator of the PPO ratio: the learner's log-probs before the update, or the rollout engine's."""

    def __post_init__(self):
        _at_least(self, 0, "steps", "warmup_steps")
        _at_least(self, 1, "prompts_per_step", "task_length", "minibatches", "micro_batches")
        if self.task not in ("copy", "reverse", "sort"):
            raise ValueError(f"task must be one of copy, reverse, sort; got {self.task!r}")
        if not 2 <= self.task_digits <= 10:
            raise ValueError(f"task_digits must be in 2..10, got {self.task_digits}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0 (0 disables the KL term), got {self.kl_coef}")
        if not self.is_threshold > 1:
            raise ValueError(f"is_threshold must be > 1, got {self.is_threshold}")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go (None: no checkpoints); relative to the YAML file (module docstring)."""
    every: int = 0
    """Save every N steps (0: only at the end)."""
    resume: bool = True
    """Resume from the latest checkpoint in `dir` if there is one."""
    resume_from: str | None = None
    """A checkpoint directory (step_NNNNNN) or state.pt to resume from; an error if it is missing or corrupt."""
    keep: int = 2
    """How many of the newest checkpoints to keep in `dir` (0: all)."""

    def __post_init__(self):
        _at_least(self, 0, "every", "keep")


@dataclass(kw_only=True)
class LoggingConfig:
    dir: str = "runs/tiny"
    """TensorBoard event files, the metrics JSONL and the log file go here; relative to the YAML file (module
    docstring)."""
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass(kw_only=True)
class AlignmentConfig:
    """Learner/rollout alignment (docs/alignment.md): strict mode, routing replay, the log-prob gap monitor."""

    strict: bool = False
    """Strict mode: every forward op of learner and rollout computed batch-invariantly (minite.megatron_patches.strict);
    the learner's full-sequence log-probs then equal the rollout's decode log-probs. Slower; needs tp = 1."""
    routing_replay: bool = False
    """Default-mode mitigation: the learner replays the experts the rollout routed each token to
    (minite.alignment.routing_replay), so MoE routing flips stop feeding the mismatch."""
    warn_above: float | None = None
    """Log a warning in the RL loop when a step's max |logp_learner - logp_rollout| exceeds this (None: never)."""
    stop_above: float | None = None
    """Stop the RL run (AlignmentError) when a step's max |logp gap| exceeds this (None: never)."""

    def __post_init__(self):
        for name in ("warn_above", "stop_above"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"{name} must be >= 0 or null, got {v}")
        if self.warn_above is not None and self.stop_above is not None and self.stop_above < self.warn_above:
            raise ValueError(f"stop_above ({self.stop_above}) must be >= warn_above ({self.warn_above})")
        if self.strict and self.routing_replay:
            raise ValueError("strict and routing_replay are exclusive: strict mode already routes identically")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)
    source: str | None = field(default=None, metadata={"internal": True})
    """The YAML file this was loaded from (set by load_config); internal: not a key of the YAML file."""

    def __post_init__(self):
        if self.alignment.strict and self.parallel.tp != 1:
            raise ValueError("alignment.strict needs parallel.tp = 1 (expert parallelism is fine)")
        if self.rollout.backend == "sglang" and (self.parallel.tp, self.parallel.ep) != (1, 1):
            raise ValueError(f"rollout.backend=sglang takes weight updates from a learner with parallel.tp = parallel.ep "
                             f"= 1 for now (got tp={self.parallel.tp}, ep={self.parallel.ep}): use rollout.backend="
                             "embedded, or data parallelism alone")
        if self.model.hf_config is None:  # otherwise the shape is in that file: check_model_shape(model_shape(cfg))
            check_model_shape(self.model, self)


def check_model_shape(shape, cfg: "Config") -> None:
    """ValueError unless `shape` (ModelConfig fields, or a Qwen3MoeShape read from model.hf_config) fits cfg's
    precision and parallel layout: heads and query groups split over tp, experts over ep, and in NVFP4 every dimension
    of a quantised weight a multiple of 16 (its 16x16 blocks) on each tensor-parallel rank."""
    if shape.moe_router_topk == 1 and shape.norm_topk_prob:  # Megatron-Core's TransformerConfig refuses it too
        fix = (f"set norm_topk_prob to false in {cfg.model.hf_config}" if cfg.model.hf_config
               else "set model.norm_topk_prob=false")
        raise ValueError("model.moe_router_topk=1 with model.norm_topk_prob=true gives every token's one expert the "
                         f"weight 1 and the router no gradient: {fix} (softmax before the top-1, the router's "
                         "probability as the weight)")
    tp, ep = cfg.parallel.tp, cfg.parallel.ep
    for name, n, by, what in (("num_attention_heads", shape.num_attention_heads, tp, "parallel.tp"),
                              ("num_query_groups", shape.num_query_groups, tp, "parallel.tp"),
                              ("num_experts", shape.num_experts, ep, "parallel.ep")):
        if n % by:
            raise ValueError(f"model.{name}={n} is not divisible by {what}={by}: choose a {what} that divides it")
    if cfg.precision.mode != "nvfp4":
        return
    bf16 = set(cfg.precision.recipe.bf16_modules)
    dims = [("hidden_size", shape.hidden_size)]
    if "attention_linears" not in bf16:
        qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim // tp  # fused q, k, v
        dims += [("(num_attention_heads + 2 x num_query_groups) x head_dim / parallel.tp", qkv_rows),
                 ("num_attention_heads x head_dim / parallel.tp", shape.num_attention_heads * shape.head_dim // tp)]
    if "experts" not in bf16:
        dims.append(("moe_ffn_hidden_size", shape.moe_ffn_hidden_size))
    if "mlp" not in bf16 and shape.shared_expert_intermediate_size:
        dims.append(("shared_expert_intermediate_size", shape.shared_expert_intermediate_size))
    for name, n in dims:
        if n % 16:
            raise ValueError(f"model {name} = {n} is not a multiple of 16, which NVFP4's 16x16 weight blocks need: "
                             f"change it, or use precision.mode=bf16")


def check_world_size(cfg: Config, world_size: int) -> None:
    """ConfigError unless parallel.tp x parallel.pp and parallel.ep divide the number of processes."""
    par = cfg.parallel
    if world_size % (par.tp * par.pp) or world_size % par.ep:
        raise ConfigError(f"parallel.tp={par.tp} x parallel.pp={par.pp} and parallel.ep={par.ep} must divide the "
                          f"{world_size} process(es) started: launch a multiple of them (tools/launch/torchrun.sh) "
                          "or lower them with --set")


def check_paths(cfg: Config) -> None:
    """ConfigError when a file the config names as input does not exist, or a directory it writes to is a file, lies
    under one or cannot be written (before anything is built)."""
    for key, value, want in (("model.hf_config", cfg.model.hf_config, Path.is_file),
                             ("model.init_from", cfg.model.init_from, Path.is_dir),
                             ("checkpoint.resume_from", cfg.checkpoint.resume_from, Path.exists)):
        if value and not want(Path(value)):
            raise ConfigError(f"{key}: {value} does not exist (a relative path in a YAML file is relative to that "
                              "file's directory, one given with --set to the current directory)")
    for key, value in (("logging.dir", cfg.logging.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        nearest = Path(value or ".")
        try:
            while not nearest.exists() and nearest != nearest.parent:
                nearest = nearest.parent
        except OSError as e:  # e.g. a parent this process may not search
            raise ConfigError(f"{key}: {value} cannot be reached ({e.strerror or type(e).__name__}): name another "
                              "directory") from None
        if not nearest.is_dir():
            what = "is a file" if nearest == Path(value) else f"lies under the file {nearest}"
            raise ConfigError(f"{key}: {value} {what}, not a directory: name a directory (one that does not exist "
                              "yet is created)")
        if not os.access(nearest, os.W_OK | os.X_OK):  # else the first checkpoint fails, after the steps it keeps
            raise ConfigError(f"{key}: {value} cannot be written by this process ({nearest} is not writable): name "
                              "another directory")


def apply_overrides(raw: dict, overrides: list[str], where: str) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a raw nested mapping. Each is checked on its own
    against Config's fields and types first, so an error names the `--set` item rather than the file."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value, e.g. --set rl.steps=5")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        try:
            value = load_yaml(text, f"--set {item}")
        except yaml.YAMLError:
            raise ConfigError(f"--set {item}: the value is not a valid YAML scalar") from None
        check_key(Config, item, parts, value)
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {part!r} in {where} is not a section")
        node[parts[-1]] = value
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML file (None: defaults) and apply overrides; errors name the key and the file."""
    where = str(path) if path is not None else "<defaults>"
    raw: dict = {}
    if path is not None:
        try:
            raw = load_yaml(Path(path).read_text(encoding="utf-8"), str(path)) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"{path} is a directory: give a YAML file, e.g. examples/tiny/nvfp4.yaml") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8): give a YAML file, e.g. "
                              "examples/tiny/nvfp4.yaml") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        _resolve_yaml_paths(raw, Path(path).parent)
    raw = apply_overrides(raw, overrides or [], where)
    try:
        cfg = from_dict(Config, raw, where)
    except ConfigError as e:  # a value check: name the overrides of the keys it names
        touched = [o for o in overrides or [] if _names_key(str(e)[len(where):], o.split("=", 1)[0].strip())]
        raise ConfigError(f"{e} (with --set {' --set '.join(touched)})" if touched else str(e)) from None
    cfg.source = str(path) if path is not None else None
    return cfg


def _names_key(message: str, key: str) -> bool:
    """Whether an error message names `key` (a.b.c): whole, or its last part beside its section's name (`rl: steps
    must be ...`, `model hidden_size = 40 ...`)."""
    words = set(re.findall(r"[\w.]+", message))
    section, _, name = key.rpartition(".")
    return key in words or name in words and (not section or section in words)


def _resolve_yaml_paths(raw: dict, base: Path) -> None:
    """Relative PATH_FIELDS written in the YAML file -> relative to its directory (module docstring). normpath keeps
    a path relative to the current directory readable (examples/tiny/../../runs -> runs)."""
    for section, key in PATH_FIELDS:
        node = raw.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute():
            node[key] = os.path.normpath(base / value)


def to_dict(cfg) -> dict:
    """A plain mapping (tuples as lists) that load_config reads back to an equal Config."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def config_from_args(args) -> Config:
    """load_config for a command's parsed arguments (minite.cli_args.add_config_arguments); ConfigError for a
    missing or doubled config argument."""
    given = [p for p in (args.config, getattr(args, "config_option", None)) if p is not None]  # callers' namespaces
    if not given:
        raise ConfigError("no config given: name a YAML file, e.g. examples/tiny/nvfp4.yaml")
    if len(given) == 2 and given[0] != given[1]:
        raise ConfigError(f"two configs given ({given[0]} and --config {given[1]}): give one")
    return load_config(given[0], args.overrides)
