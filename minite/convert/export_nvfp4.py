"""`minite convert export-nvfp4`: a Qwen3-MoE checkpoint -> Hugging Face safetensors in ModelOpt's NVFP4 naming.

    minite convert export-nvfp4 --hf DIR --out DIR          (a Hugging Face Qwen3-MoE BF16/FP32 checkpoint)
    minite convert export-nvfp4 --megatron DIR --out DIR    (a checkpoint of `minite convert hf-to-megatron`)
A Megatron checkpoint is read as its Hugging Face tensors, each assembled from its TP/EP pieces when the export reads
it (`_MegatronReader`, the plan megatron-to-hf writes by): no Hugging Face copy is written anywhere. Either source
is read a layer at a time; a tensor holding NaN or Inf stops the export, named, before anything lands in --out.

What is written (the names stock SGLang/vLLM load as `modelopt_fp4`; minite.nvfp4.modelopt):
    <linear>.weight          uint8 [N, K/2]           E2M1 codes, even element in the low nibble
    <linear>.weight_scale    float8_e4m3fn [N, K/16]  one E4M3 scale per 1x16 block
    <linear>.weight_scale_2  float32 []               the global decode scale fl(amax / 2688), as ModelOpt writes it
    <linear>.weight_scale_amax  float32 []            the amax itself (TE's GEMM alpha needs it exactly; stock
                                                      SGLang skips names its method has no parameter for)
    <linear>.input_scale     float32 []               a static activation decode scale (--input-scale, default 1)
for every q/k/v/o projection and every expert's gate/up/down projection; embeddings, norms, router (mlp.gate) and
lm_head stay in the source dtype and are listed in hf_quant_config.json's exclude_modules. hf_quant_config.json:
{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16, ...}, "minite": {the
activation recipe}}; config.json, tokenizer and other small files are copied.

Which values: exactly those the learner computes with. The learner quantises each Megatron weight as one tensor
(`minite.ops.quantize_weight`: 16x16 blocks, one global scale): the fused QKV weight (Megatron's interleaved
per-KV-group layout), each expert's fc1 = [gate; up] and fc2, the attention output projection. The export builds those
same fused tensors, quantises them with the same function, then cuts the rows apart into q/k/v (gate/up): q, k and v
therefore share one weight_scale_2, as do an expert's gate and up. ModelOpt uses 1x16 blocks; a 16x16 block's scale
repeated over its 16 rows is a 1x16 scale grid describing the same values, so the export is lossless: dequantising
the export equals dequantising the learner's weight, bit for bit (tests/rollout/sglang/test_export.py).

Static input_scale vs per-row activation scales: see docs/sglang.md. The minite_nvfp4 plugin ignores input_scale.
`pack_megatron_weights` is the same conversion for in-memory learner weights (the SGLang backend's weight updates).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from minite.convert.files import check_out, input_dir, read_json_object, staged_output
from minite.convert.hf_megatron import Target, assemble_rows, hf_plan_of_megatron, scan_hf, target_dtype
from minite.convert.safetensors_stream import ConversionError, RowReader, TensorEntry, refuse_nonfinite, view2d
from minite.nvfp4 import NVFP4Recipe
from minite.nvfp4.modelopt import quant_config_dict, scale_grid_1x16
from minite.ops import quantize_weight

INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024 ** 3


class ExportError(ConversionError):
    """The source checkpoint cannot be exported (names the tensor or file); a user error, as every ConversionError."""


def quantize_module(weight: torch.Tensor, recipe: NVFP4Recipe, backend: str = "auto"):
    """(codes uint8 [N, K/2], scales e4m3 [N, K/16], weight_scale_2 fp32 [], amax fp32 []) of the learner's
    quantisation of weight [N, K]; weight_scale_2 = fl(amax / 2688) (NVFP4Tensor.decode_scale), so a ModelOpt
    loader's e2m1 * scale * weight_scale_2 is the learner's dequantize(), bit for bit."""
    q = quantize_weight(weight, recipe, backend=backend)
    return q.data, scale_grid_1x16(q), q.decode_scale().reshape(()).float(), q.decode_amax().reshape(()).float()


def _emit(prefix: str, parts: List[Tuple[str, object]], w, input_scale: Optional[float]):
    """HF tensors for row selections (hf name, slice or index) of one fused weight, one linear each.

    `w` is the BF16 tensor itself (written as it is) or a packed NVFP4 tuple (data, scale grid, weight_scale_2,
    amax), written in ModelOpt naming: weight, weight_scale, weight_scale_2, plus weight_scale_amax (and input_scale
    when asked for).
    """
    for name, sel in parts:
        if not isinstance(w, tuple):
            yield f"{prefix}{name}.weight", w[sel]
            continue
        data, scale, gs, amax = w
        yield f"{prefix}{name}.weight", data[sel].contiguous()
        yield f"{prefix}{name}.weight_scale", scale[sel].contiguous()
        yield f"{prefix}{name}.weight_scale_2", gs.clone()
        yield f"{prefix}{name}.weight_scale_amax", amax.clone()
        if input_scale is not None:
            yield f"{prefix}{name}.input_scale", torch.tensor(float(input_scale), dtype=torch.float32)


def qkv_rows(hf_cfg: dict) -> List[Tuple[str, int, int, int]]:
    """Megatron's fused QKV row layout: (hf name q/k/v, kv group, first row in the fused tensor, rows)."""
    heads = hf_cfg["num_attention_heads"]
    groups = hf_cfg.get("num_key_value_heads") or heads
    d = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // heads
    qpg, out, row = heads // groups, [], 0
    for g in range(groups):
        for name, n in (("q_proj", qpg * d), ("k_proj", d), ("v_proj", d)):
            out.append((name, g, row, n))
            row += n
    return out


def _qkv_parts(hf_cfg: dict) -> List[Tuple[str, torch.Tensor]]:
    """(q/k/v, fused-QKV row index in HF order: group-major within each of q, k, v)."""
    rows: Dict[str, list] = {"q_proj": [], "k_proj": [], "v_proj": []}
    for name, _g, r0, n in qkv_rows(hf_cfg):
        rows[name].append(torch.arange(r0, r0 + n))
    return [(name, torch.cat(idx)) for name, idx in rows.items()]


_RENAME = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER_RENAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def learner_to_hf(named: Iterable[Tuple[str, torch.Tensor]], hf_cfg: dict,
                  pack: Optional[Callable[[torch.Tensor], tuple]] = None, input_scale: Optional[float] = None
                  ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Learner (Megatron local-spec, tp=ep=pp=1) tensors -> Hugging Face Qwen3-MoE names.

    pack=None keeps every tensor as it is (a BF16 checkpoint); otherwise each linear/expert weight is packed by
    `pack` and written in ModelOpt NVFP4 naming. Raises ExportError for a name it does not know (nothing dropped).
    """
    for name, t in named:
        while name.startswith("module."):
            name = name[len("module."):]
        if name in _RENAME:
            yield _RENAME[name], t
            continue
        parts = name.split(".")
        if len(parts) < 4 or parts[:2] != ["decoder", "layers"]:
            raise ExportError(f"unknown learner tensor {name!r}")
        hf, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
        packed = (lambda w: w) if pack is None else pack
        if rest in _LAYER_RENAME:
            yield hf + _LAYER_RENAME[rest], t
        elif rest == "self_attention.linear_qkv.weight":
            yield from _emit(hf + "self_attn.", _qkv_parts(hf_cfg), packed(t), input_scale)
        elif rest == "self_attention.linear_proj.weight":
            yield from _emit(hf + "self_attn.", [("o_proj", slice(0, t.shape[0]))], packed(t), input_scale)
        elif rest in ("mlp.experts.fc1_weight", "mlp.experts.fc2_weight"):
            yield from _experts(hf + "mlp.experts.", rest.endswith("fc1_weight"), t, packed, input_scale)
        elif not rest.endswith("_extra_state"):
            raise ExportError(f"unknown learner tensor {name!r} (layer part {rest!r})")


def pack_megatron_weights(named: Iterable[Tuple[str, torch.Tensor]], hf_cfg: dict, recipe: NVFP4Recipe, *,
                          backend: str = "auto", input_scale: Optional[float] = None
                          ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Learner tensors -> HF ModelOpt-named tensors, NVFP4 where the learner is (see `learner_to_hf`)."""
    return learner_to_hf(named, hf_cfg, lambda w: quantize_module(w, recipe, backend), input_scale)


def _experts(prefix, is_fc1, w, packed, input_scale):
    for e in range(w.shape[0]):
        if is_fc1:
            f = w.shape[1] // 2
            parts = [("gate_proj", slice(0, f)), ("up_proj", slice(f, 2 * f))]
        else:
            parts = [("down_proj", slice(0, w.shape[1]))]
        yield from _emit(f"{prefix}{e}.", parts, packed(w[e]), input_scale)


def exclude_modules(hf_cfg: dict) -> List[str]:
    """Modules the export keeps unquantised (the learner keeps them BF16): router gates and lm_head."""
    return ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(hf_cfg["num_hidden_layers"])]


# ---------------------------------------------------------------------------------------------------------------
# Reading a Hugging Face checkpoint as the learner's fused tensors, one layer at a time
# ---------------------------------------------------------------------------------------------------------------
class _HFReader:
    """Lazy tensor access over a HF directory (model.safetensors or an index of shards); with check_finite, a
    floating-point tensor holding NaN or Inf raises an ExportError naming it (weights no engine can run)."""

    def __init__(self, hf_dir: Path, check_finite: bool = False):
        from safetensors import safe_open

        index = hf_dir / INDEX_FILE
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if not files:
            raise ExportError(f"{hf_dir}: no *.safetensors files")
        self.hf_dir, self.check_finite = hf_dir, check_finite
        self.handles = [safe_open(str(hf_dir / f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def close(self) -> None:
        self.handles, self.where = [], {}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ExportError(f"missing tensor {name!r} in the Hugging Face checkpoint")
        t = self.where[name].get_tensor(name)
        if self.check_finite:
            refuse_nonfinite(t, name, self.hf_dir)
        return t


class _MegatronReader:
    """`_HFReader`'s access over a checkpoint of `minite convert hf-to-megatron`: each Hugging Face tensor assembled
    from its TP/EP pieces when asked for (hf_plan_of_megatron), so no Hugging Face copy is written; a source holding
    NaN or Inf stops the export, named (`assemble_rows`; replicas are checked by hf_plan_of_megatron)."""

    def __init__(self, mg_dir: Path, hf_plan: Dict[str, List[Target]], found: Dict[str, TensorEntry]):
        self.mg_dir, self.found, self.rows = mg_dir, found, RowReader()
        self.targets = {tg.name: tg for tgs in hf_plan.values() for tg in tgs}
        self.dtypes = {name: target_dtype(tg, found) for name, tg in self.targets.items()}  # mixed: refused here

    def has(self, name: str) -> bool:
        return name in self.targets

    def get(self, name: str) -> torch.Tensor:
        if name not in self.targets:
            raise ExportError(f"missing tensor {name!r} in the Megatron checkpoint {self.mg_dir}")
        tg = self.targets[name]
        return assemble_rows(tg, self.dtypes[name], self.found, self.rows, 0, view2d(tg.shape)[0]).reshape(tg.shape)

    def close(self) -> None:
        self.rows.close()


def _hf_experts(r: _HFReader, p: str, n_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fc1 [E, 2F, H] = [gate; up] and fc2 [E, H, F] from per-expert tensors or transformers-5 fused ones."""
    if r.has(p + "gate_up_proj"):
        return r.get(p + "gate_up_proj"), r.get(p + "down_proj")
    fc1 = torch.stack([torch.cat([r.get(f"{p}{e}.gate_proj.weight"), r.get(f"{p}{e}.up_proj.weight")])
                       for e in range(n_experts)])
    fc2 = torch.stack([r.get(f"{p}{e}.down_proj.weight") for e in range(n_experts)])
    return fc1, fc2


def megatron_view_of_hf(r: _HFReader, hf_cfg: dict) -> Iterator[Tuple[str, torch.Tensor]]:
    """The learner's tensors (Megatron names, tp=ep=pp=1) built from a HF checkpoint, layer by layer."""
    yield "embedding.word_embeddings.weight", r.get("model.embed_tokens.weight")
    n_experts = hf_cfg.get("num_experts") or hf_cfg["num_local_experts"]
    for i in range(hf_cfg["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mg_rest, hf_rest in _LAYER_RENAME.items():
            yield mg + mg_rest, r.get(hf + hf_rest)
        q, k, v = (r.get(f"{hf}self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj"))
        src = {"q_proj": q, "k_proj": k, "v_proj": v}
        seen = {"q_proj": 0, "k_proj": 0, "v_proj": 0}
        pieces = []
        for name, _g, _r0, n in qkv_rows(hf_cfg):
            pieces.append(src[name][seen[name]:seen[name] + n])
            seen[name] += n
        yield mg + "self_attention.linear_qkv.weight", torch.cat(pieces)
        yield mg + "self_attention.linear_proj.weight", r.get(hf + "self_attn.o_proj.weight")
        fc1, fc2 = _hf_experts(r, hf + "mlp.experts.", n_experts)
        yield mg + "mlp.experts.fc1_weight", fc1
        yield mg + "mlp.experts.fc2_weight", fc2
    yield "decoder.final_layernorm.weight", r.get("model.norm.weight")
    if not hf_cfg.get("tie_word_embeddings", False):
        yield "output_layer.weight", r.get("lm_head.weight")


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------
def write_sharded(out_dir: Path, tensors: Iterable[Tuple[str, torch.Tensor]], shard_bytes: int = SHARD_BYTES) -> int:
    """Safetensors shards of at most ~shard_bytes plus model.safetensors.index.json; returns the tensor count."""
    from safetensors.torch import save_file

    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        if name in (k for s in shards for k in s):
            raise ExportError(f"tensor {name!r} produced twice")
        shards[-1][name] = t.contiguous()
        size += n
    total, weight_map, total_size = len(shards), {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = fname
            total_size += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return len(weight_map)


def _small_files(files: Iterable[Path]) -> List[Path]:
    """Of `files` (a HF directory's, or those a Megatron checkpoint kept of one), those to copy beside the export:
    config, tokenizer, generation config; not weights of any format, not 64 MiB or more (a .bin twin of the
    weights, say), not an index or a quantisation config of their own."""
    return [p for p in sorted(files) if p.is_file() and not p.name.endswith(".safetensors")
            and p.name not in (INDEX_FILE, "hf_quant_config.json") and p.stat().st_size < 64 * 1024 ** 2]


def check_input_scale(input_scale: Optional[float]) -> None:
    """ExportError unless input_scale is None (not written) or, as the float32 written, finite and > 0: a decode
    scale, which an engine divides each activation block's amax by (times 6; docs/sglang.md)."""
    if input_scale is None:
        return
    written = torch.tensor(float(input_scale), dtype=torch.float32).item()
    if not (math.isfinite(written) and written > 0):
        raise ExportError(f"--input-scale {input_scale}: must be a finite number > 0 in float32 (a static activation "
                          "decode scale, which engines divide by)")


def export_nvfp4(*, out_dir, hf_dir=None, megatron_dir=None, recipe: Optional[NVFP4Recipe] = None,
                 input_scale: float = 1.0, backend: str = "auto") -> Path:
    """Write the ModelOpt-named NVFP4 checkpoint (module docstring) from a HF or a Megatron checkpoint."""
    if (hf_dir is None) == (megatron_dir is None):
        raise ExportError("give exactly one of --hf DIR or --megatron DIR")
    check_input_scale(input_scale)
    out_dir = check_out(out_dir)
    if megatron_dir is not None:
        mg_dir = input_dir(megatron_dir, "--megatron")
        meta, hf_plan, found, small = hf_plan_of_megatron(mg_dir)
        hf_cfg, reader = meta["hf_config"], _MegatronReader(mg_dir, hf_plan, found)
        small_files = _small_files(mg_dir / name for name in small)
    else:
        hf_dir = input_dir(hf_dir, "--hf")
        cfg_path = hf_dir / "config.json"
        if not cfg_path.exists():
            raise ExportError(f"{hf_dir}: no config.json")
        hf_cfg = read_json_object(cfg_path)
        scan_hf(hf_dir, fused_experts=True)  # model_type, the config's numbers, the index, every header and shape
        reader, small_files = _HFReader(hf_dir, check_finite=True), _small_files(hf_dir.iterdir())
    recipe = recipe or NVFP4Recipe()
    try:
        with staged_output(out_dir) as stage:
            packed = pack_megatron_weights(megatron_view_of_hf(reader, hf_cfg), hf_cfg, recipe, backend=backend,
                                           input_scale=input_scale)
            write_sharded(stage, packed)
            for f in small_files:
                shutil.copyfile(f, stage / f.name)
            if not (stage / "config.json").exists():  # a Megatron checkpoint keeps the config in its metadata
                (stage / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
            qcfg = quant_config_dict(recipe, exclude_modules(hf_cfg))
            (stage / "hf_quant_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
    finally:
        reader.close()
    return out_dir


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="Hugging Face Qwen3-MoE checkpoint directory (config.json, *.safetensors)")
    src.add_argument("--megatron", help="a directory written by `minite convert hf-to-megatron`")
    p.add_argument("--out", required=True, help="output directory (created; must not exist or be empty)")
    p.add_argument("--input-scale", type=float, default=1.0,
                   help="static activation decode scale written as input_scale for engines that need one, finite "
                        "and > 0 (docs/sglang.md; the minite_nvfp4 plugin ignores it). Default 1.0")


def run(args) -> int:
    """`minite convert export-nvfp4`; an ExportError goes on to minite/cli.py (one line, status 2)."""
    out = export_nvfp4(out_dir=args.out, hf_dir=args.hf, megatron_dir=args.megatron, input_scale=args.input_scale)
    print(f"wrote {out}")
    return 0
