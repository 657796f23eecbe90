"""Qwen3-MoE checkpoints, Hugging Face <-> the learner's Megatron-Core layout, converted by streaming.

Commands (arguments in minite/convert/cli.py, entry points run_hf_to_megatron / run_megatron_to_hf at the end):
    minite convert hf-to-megatron --hf DIR --out DIR [--tp N] [--ep N] [--pp N]
    minite convert megatron-to-hf --megatron DIR --out DIR

The Megatron side: per-rank sharded safetensors + one metadata JSON
--------------------------------------------------------------------
    OUT/minite_checkpoint.json         format, tp/ep/pp, the HF config, every file's tensor list, the HF file layout
    OUT/config.json (+ tokenizer etc.) the HF side's small files, copied verbatim (megatron-to-hf copies them back)
    OUT/dense_tp{t:02d}_pp{p:03d}.safetensors    what TP rank t of pipeline stage p holds outside the experts
    OUT/experts_pp{p:03d}_ep{e:03d}.safetensors  what EP rank e of stage p holds: its experts (expert TP is 1)
A rank (t, p, e) loads its two files with `load_into_model`; the names are exactly the local-spec GPTModel's
state-dict keys on that rank (megatron_patches/qwen3_moe.py), with Megatron's stage-local layer numbers.
Why not megatron.core.dist_checkpointing: it needs each module's `sharded_state_dict` to describe its sharding,
and the learner's GroupedExperts (a MegatronModule with the default one) would record its EP-local experts as a
replicated tensor; and its torch_dist writer takes the whole state dict in one call, so streaming a 30B model would
need a custom save planner. Per-rank files are written tensor by tensor, load with plain `load_state_dict`, and are
readable without Megatron. The price: no resharding at load; reshard by converting again (either direction is
a streaming pass).

The name and layout map (HF `model.layers.L.` -> Megatron `decoder.layers.l.`, l = L - first layer of the stage)
    embed_tokens.weight [V, H]                -> embedding.word_embeddings.weight, rows split over TP (vocab-parallel)
    self_attn.{q,k,v}_proj.weight             -> self_attention.linear_qkv.weight, Megatron's interleaved layout:
        for each KV group g: [q rows of the heads of g (heads/groups * d); k rows of g (d); v rows of g (d)],
        groups split contiguously over TP (rank t holds groups [t G/tp, (t+1) G/tp))
    self_attn.o_proj.weight [H, heads d]      -> self_attention.linear_proj.weight, columns split over TP
    self_attn.{q,k}_norm.weight               -> self_attention.{q,k}_layernorm.weight (replicated)
    input_layernorm / post_attention_layernorm -> input_layernorm / pre_mlp_layernorm (replicated)
    mlp.gate.weight [E, H]                    -> mlp.router.weight (replicated)
    mlp.experts.X.{gate,up}_proj.weight [F,H] -> mlp.experts.fc1_weight [E/ep, 2F, H], expert j: [gate; up]
    mlp.experts.X.down_proj.weight [H, F]     -> mlp.experts.fc2_weight [E/ep, H, F]
    model.norm.weight, lm_head.weight         -> decoder.final_layernorm.weight, output_layer.weight (rows over TP)
Every Megatron tensor, viewed as 2-D [rows, prod(rest)], is a set of rectangular pieces of HF tensors placed at
row/column offsets (a `Piece`). The whole conversion is one list of such placements (`plan_hf_to_megatron`);
megatron-to-hf runs the same list inverted, so both directions move identical bytes and a round trip is bitwise.

Streaming: a destination tensor is assembled CHUNK_BYTES of rows at a time from row-range reads of its sources
(safetensors_stream: seek + readinto, no mmap) and appended to its file; peak memory is about two chunks plus the
interpreter, whatever the model size. Measured (tools/convert_memory.py, under an RLIMIT_AS cap of 128 MiB above the
interpreter): a 3.0 GiB random model, tp=2 ep=4, converted both ways with 32 / 39 MiB of peak-RSS growth (256 / 263
MiB peak RSS in all), round trip bitwise.
Checks before anything is written: --out absent or empty, config.json (a Qwen3-MoE model_type, sizes that are
positive integers), an index or minite_checkpoint.json that is not the JSON expected, malformed safetensors headers,
missing, extra and misshapen tensors (named with their file), an index that names a tensor its file lacks,
truncated files (a tensor's bytes past the end of its file), the small files a Megatron checkpoint lists. A
tensor holding NaN or Inf stops the conversion when its rows are read (named, with its source file): such weights
would only surface as a diverged first step. The output is written into a staging directory and moved into --out
at the end (minite/convert/files.py): a failed or interrupted conversion leaves no partial --out.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from minite.models.qwen3_moe import Qwen3MoeShape, qwen3_moe_fields
from minite.ops import first_nonfinite
from minite.convert.files import check_out, input_dir, plain_name, read_index, read_json_object, staged_output
from minite.convert.safetensors_stream import (
    DTYPES, ConversionError, RowReader, StreamWriter, TensorEntry, read_header, refuse_nonfinite, view2d,
)

FORMAT = "minite-megatron-sharded-safetensors/1"
META_FILE = "minite_checkpoint.json"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 1024 * 1024  # rows of one target assembled at a time; peak ~ 2-3x this
HF_SHARD_BYTES = 4 * 1024 ** 3  # default HF shard size when the checkpoint carries no HF layout


def read_shape(hf: dict, where: str = "config.json") -> Qwen3MoeShape:
    """The shape of a Hugging Face Qwen3-MoE config.json; ConversionError naming `where` for what is not converted:
    another model_type, what `qwen3_moe_fields` refuses (not an object, a size that is not a positive integer),
    shared experts."""
    if isinstance(hf, dict) and hf.get("model_type") != "qwen3_moe":
        raise ConversionError(f"{where}: model_type {hf.get('model_type')!r}; only Qwen3-MoE (qwen3_moe) is converted")
    try:
        shape = Qwen3MoeShape(**qwen3_moe_fields(hf, where))
    except ValueError as e:
        raise ConversionError(str(e)) from None
    except TypeError as e:
        raise ConversionError(f"{where}: {e}") from None
    if shape.shared_expert_intermediate_size:
        raise ConversionError(f"{where}: shared experts are not part of Qwen3-MoE and not converted")
    if shape.num_attention_heads % shape.num_query_groups:
        raise ConversionError(f"{where}: num_key_value_heads {shape.num_query_groups} does not divide "
                              f"num_attention_heads {shape.num_attention_heads}")
    return shape


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def check(self, s: Qwen3MoeShape) -> None:
        for name, n in (("tp", self.tp), ("ep", self.ep), ("pp", self.pp)):
            if n < 1:
                raise ConversionError(f"--{name} {n}: must be >= 1")
        for name, n, field, what in (("tp", self.tp, "num_key_value_heads", s.num_query_groups),
                                     ("tp", self.tp, "vocab_size", s.vocab_size),
                                     ("ep", self.ep, "num_experts", s.num_experts),
                                     ("pp", self.pp, "num_hidden_layers", s.num_layers)):
            if what % n:
                raise ConversionError(f"--{name} {n} does not divide the model's {field} {what}")
        if s.tie_word_embeddings and self.pp > 1:
            raise ConversionError("tied embeddings with --pp > 1 are not supported")


@dataclass(frozen=True)
class Piece:
    """Rows [r0, r1) and columns [c0, c1) of tensor `src` (2-D view) go to (dst_row, dst_col) of the target."""

    src: str
    r0: int
    r1: int
    c0: int
    c1: int
    dst_row: int
    dst_col: int = 0


@dataclass
class Target:
    """One tensor to write: its name, full shape and the pieces that tile it; `replica` marks a copy of a
    tensor that another file holds too (read back from the first copy only)."""

    name: str
    shape: Tuple[int, ...]
    pieces: List[Piece] = field(default_factory=list)
    replica: bool = False



def dense_file(t: int, p: int) -> str:
    return f"dense_tp{t:02d}_pp{p:03d}.safetensors"


def experts_file(p: int, e: int) -> str:
    return f"experts_pp{p:03d}_ep{e:03d}.safetensors"


def hf_shapes(s: Qwen3MoeShape) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a Hugging Face Qwen3-MoE checkpoint holds, with its shape, in canonical order."""
    d, h = s.head_dim, s.hidden_size
    out = {"model.embed_tokens.weight": (s.vocab_size, h)}
    for L in range(s.num_layers):
        p = f"model.layers.{L}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (s.num_attention_heads * d, h),
                    p + "self_attn.k_proj.weight": (s.num_query_groups * d, h), p + "self_attn.v_proj.weight": (s.num_query_groups * d, h),
                    p + "self_attn.o_proj.weight": (h, s.num_attention_heads * d), p + "self_attn.q_norm.weight": (d,),
                    p + "self_attn.k_norm.weight": (d,), p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate.weight": (s.num_experts, h)})
        for x in range(s.num_experts):
            out.update({f"{p}mlp.experts.{x}.gate_proj.weight": (s.moe_ffn_hidden_size, h),
                        f"{p}mlp.experts.{x}.up_proj.weight": (s.moe_ffn_hidden_size, h),
                        f"{p}mlp.experts.{x}.down_proj.weight": (h, s.moe_ffn_hidden_size)})
    out["model.norm.weight"] = (h,)
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = (s.vocab_size, h)
    return out


def _whole(src: str, shape: Tuple[int, ...], replica: bool = False, name: str = "") -> Target:
    rows, cols = view2d(shape)
    return Target(name, shape, [Piece(src, 0, rows, 0, cols, 0)], replica)


def _attention(s: Qwen3MoeShape, hf: str, mg: str, t: int, tp: int) -> List[Target]:
    d, h = s.head_dim, s.hidden_size
    qpg, gpr = s.num_attention_heads // s.num_query_groups, s.num_query_groups // tp
    qkv = Target(mg + "linear_qkv.weight", (gpr * (qpg + 2) * d, h))
    row = 0
    for g in range(t * gpr, (t + 1) * gpr):
        for src, r0, n in ((hf + "q_proj.weight", g * qpg * d, qpg * d), (hf + "k_proj.weight", g * d, d),
                           (hf + "v_proj.weight", g * d, d)):
            qkv.pieces.append(Piece(src, r0, r0 + n, 0, h, row))
            row += n
    width = s.num_attention_heads * d // tp
    proj = Target(mg + "linear_proj.weight", (h, width), [Piece(hf + "o_proj.weight", 0, h, t * width,
                                                                (t + 1) * width, 0)])
    rep = t > 0
    return [qkv, proj, _whole(hf + "q_norm.weight", (d,), rep, mg + "q_layernorm.weight"),
            _whole(hf + "k_norm.weight", (d,), rep, mg + "k_layernorm.weight")]


def _dense_targets(s: Qwen3MoeShape, lay: Layout, t: int, p: int) -> List[Target]:
    h, rep, per = s.hidden_size, t > 0, s.num_layers // lay.pp
    vrows = s.vocab_size // lay.tp
    out = []
    if p == 0:
        out.append(Target("embedding.word_embeddings.weight", (vrows, h),
                          [Piece("model.embed_tokens.weight", t * vrows, (t + 1) * vrows, 0, h, 0)]))
    for l in range(per):
        hf, mg = f"model.layers.{p * per + l}.", f"decoder.layers.{l}."
        out.append(_whole(hf + "input_layernorm.weight", (h,), rep, mg + "input_layernorm.weight"))
        out += _attention(s, hf + "self_attn.", mg + "self_attention.", t, lay.tp)
        out.append(_whole(hf + "post_attention_layernorm.weight", (h,), rep, mg + "pre_mlp_layernorm.weight"))
        out.append(_whole(hf + "mlp.gate.weight", (s.num_experts, h), rep, mg + "mlp.router.weight"))
    if p == lay.pp - 1:
        out.append(_whole("model.norm.weight", (h,), rep, "decoder.final_layernorm.weight"))
        if not s.tie_word_embeddings:
            out.append(Target("output_layer.weight", (vrows, h),
                              [Piece("lm_head.weight", t * vrows, (t + 1) * vrows, 0, h, 0)]))
    return out


def _expert_targets(s: Qwen3MoeShape, lay: Layout, p: int, e: int) -> List[Target]:
    h, f, per, local = s.hidden_size, s.moe_ffn_hidden_size, s.num_layers // lay.pp, s.num_experts // lay.ep
    out = []
    for l in range(per):
        hf, mg = f"model.layers.{p * per + l}.mlp.experts.", f"decoder.layers.{l}.mlp.experts."
        fc1 = Target(mg + "fc1_weight", (local, 2 * f, h))
        fc2 = Target(mg + "fc2_weight", (local, h, f))
        for j in range(local):
            x = e * local + j
            fc1.pieces += [Piece(f"{hf}{x}.gate_proj.weight", 0, f, 0, h, j * 2 * f),
                           Piece(f"{hf}{x}.up_proj.weight", 0, f, 0, h, j * 2 * f + f)]
            fc2.pieces.append(Piece(f"{hf}{x}.down_proj.weight", 0, h, 0, f, j * h))
        out += [fc1, fc2]
    return out


def plan_hf_to_megatron(s: Qwen3MoeShape, lay: Layout) -> Dict[str, List[Target]]:
    """{megatron file: [targets in file order]} for the layout; sources are HF tensor names."""
    lay.check(s)
    plan = {}
    for p in range(lay.pp):
        for t in range(lay.tp):
            plan[dense_file(t, p)] = _dense_targets(s, lay, t, p)
        for e in range(lay.ep):
            plan[experts_file(p, e)] = _expert_targets(s, lay, p, e)
    return plan


def invert_plan(plan: Dict[str, List[Target]], shapes: Dict[str, Tuple[int, ...]],
                hf_files: Dict[str, List[str]]) -> Dict[str, List[Target]]:
    """The HF side as targets whose pieces read Megatron tensors (named "file::tensor"); replicas are skipped."""
    pieces: Dict[str, List[Piece]] = {name: [] for name in shapes}
    for file, targets in plan.items():
        for tg in targets:
            if tg.replica:
                continue
            for pc in tg.pieces:
                n = pc.r1 - pc.r0
                pieces[pc.src].append(Piece(f"{file}::{tg.name}", pc.dst_row, pc.dst_row + n, pc.dst_col,
                                            pc.dst_col + pc.c1 - pc.c0, pc.r0, pc.c0))
    return {f: [Target(n, shapes[n], pieces[n]) for n in names] for f, names in hf_files.items()}


# ---------------------------------------------------------------------------------------------------------------
# reading and checking a checkpoint's headers (nothing but headers is read before the checks pass)
# ---------------------------------------------------------------------------------------------------------------
def _check_tensors(expected: Dict[str, Tuple[int, ...]], found: Dict[str, TensorEntry], where: str) -> None:
    """Missing, extra and misshapen tensors, each named with its file; all problems in one message."""
    problems = []
    for name, shape in expected.items():
        entry = found.get(name)
        if entry is None:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)}; not in any file of {where})")
        elif tuple(entry.shape) != tuple(shape):
            problems.append(f"tensor {name!r} in {entry.file}: shape {list(entry.shape)}, expected {list(shape)}")
    for name in sorted(set(found) - set(expected)):
        problems.append(f"extra tensor {name!r} in {found[name].file} (not part of a Qwen3-MoE checkpoint)")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ConversionError(f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:20]) + more)


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found (a Hugging Face checkpoint directory needs its config.json)")
    return read_json_object(path)


def scan_hf(hf_dir: Path, *, fused_experts: bool = False
            ) -> Tuple[Qwen3MoeShape, Dict[str, TensorEntry], Dict[str, List[str]], dict]:
    """(shape, entries by tensor name, {file: names in byte order}, index metadata) of a HF checkpoint.

    fused_experts: the experts may also be transformers 5's fused tensors, each layer's mlp.experts.gate_up_proj
    [E, 2F, H] and down_proj [E, H, F] (what the NVFP4 export reads; hf-to-megatron reads per-expert tensors)."""
    hf_dir = input_dir(hf_dir, "--hf")
    config = _read_config(hf_dir)
    shape = read_shape(config, str(hf_dir / "config.json"))
    index_path = hf_dir / INDEX_FILE
    if index_path.is_file():
        index = read_index(index_path)
        weight_map: Optional[Dict[str, str]] = index["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (hf_dir / "model.safetensors").is_file():
        index, weight_map, files = {}, None, ["model.safetensors"]
    else:
        raise ConversionError(f"{hf_dir}: neither {INDEX_FILE} nor model.safetensors found")
    found: Dict[str, TensorEntry] = {}
    layout: Dict[str, List[str]] = {}
    for file in files:
        entries = read_header(hf_dir / file)
        layout[file] = [e.name for e in sorted(entries.values(), key=lambda e: e.begin)]
        for name, entry in entries.items():
            if weight_map is not None and weight_map.get(name) != file:
                raise ConversionError(f"extra tensor {name!r} in {entry.file}: {index_path} maps it to "
                                      f"{weight_map.get(name)!r}")
            found[name] = entry
    for name, file in (weight_map or {}).items():
        if name not in found:
            raise ConversionError(f"missing tensor {name!r}: {index_path} maps it to {hf_dir / file}, "
                                  "which does not hold it")
    expected = hf_shapes(shape)
    if fused_experts and any(name.endswith(".mlp.experts.gate_up_proj") for name in found):
        expected = {n: s for n, s in expected.items() if ".mlp.experts." not in n}
        e, f, h = shape.num_experts, shape.moe_ffn_hidden_size, shape.hidden_size
        for layer in range(shape.num_layers):
            expected[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = (e, 2 * f, h)
            expected[f"model.layers.{layer}.mlp.experts.down_proj"] = (e, h, f)
    _check_tensors(expected, found, str(hf_dir))
    return shape, found, layout, index.get("metadata") or {}


def read_meta(mg_dir: Path) -> dict:
    """minite_checkpoint.json with its format, tp/ep/pp and HF file lists checked (ConversionError); hf_config is
    checked where a conversion reads it (scan_megatron), since loading into a model does not need it."""
    path = Path(mg_dir) / META_FILE
    if not path.is_file():
        raise ConversionError(f"{path}: not found (not a checkpoint written by `minite convert hf-to-megatron`)")
    meta = read_json_object(path)
    if meta.get("format") != FORMAT:
        raise ConversionError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for key in ("tp", "ep", "pp"):
        if type(meta.get(key)) is not int or meta[key] < 1:
            raise ConversionError(f"{path}: {key} = {meta.get(key)!r}, expected an integer >= 1")
    for key, kind, what in (("hf_layout", dict, "object"), ("hf_index_metadata", dict, "object"),
                            ("hf_files", list, "list")):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise ConversionError(f"{path}: {key} is {type(meta[key]).__name__}, expected a JSON {what}")
    for file, names in (meta.get("hf_layout") or {}).items():
        plain_name(file, f"{path}: hf_layout")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConversionError(f"{path}: hf_layout[{file!r}] is not a list of tensor names")
    for file in meta.get("hf_files") or []:
        plain_name(file, f"{path}: hf_files")
    return meta


def scan_megatron(mg_dir: Path) -> Tuple[dict, Qwen3MoeShape, Dict[str, List[Target]], Dict[str, TensorEntry]]:
    """(metadata, shape, the forward plan, entries keyed "file::tensor") of a converted Megatron checkpoint."""
    mg_dir = input_dir(mg_dir, "--megatron")
    meta = read_meta(mg_dir)
    shape = read_shape(meta.get("hf_config"), f"{mg_dir / META_FILE}: hf_config")
    plan = plan_hf_to_megatron(shape, Layout(meta["tp"], meta["ep"], meta["pp"]))
    expected, found = {}, {}
    for file, targets in plan.items():
        expected.update({f"{file}::{tg.name}": tg.shape for tg in targets})
        found.update({f"{file}::{n}": e for n, e in read_header(mg_dir / file).items()})
    _check_tensors(expected, found, str(mg_dir))
    return meta, shape, plan, found


# ---------------------------------------------------------------------------------------------------------------
# writing: each target assembled CHUNK_BYTES of rows at a time
# ---------------------------------------------------------------------------------------------------------------
def target_dtype(tg: Target, sources: Dict[str, TensorEntry]) -> str:
    dtypes = {sources[pc.src].dtype for pc in tg.pieces}
    if len(dtypes) != 1:
        names = sorted({f"{pc.src} ({sources[pc.src].file}: {sources[pc.src].dtype})" for pc in tg.pieces})
        raise ConversionError(f"tensor {tg.name!r} would mix dtypes from {names}")
    return dtypes.pop()


def assemble_rows(tg: Target, dtype: str, sources: Dict[str, TensorEntry], reader: RowReader, a: int, b: int
                  ) -> torch.Tensor:
    """Rows [a, b) of target `tg`'s 2-D view, read from its pieces' sources; a source holding NaN or Inf in what is
    read stops the conversion, named (safetensors_stream.refuse_nonfinite)."""
    cols = view2d(tg.shape)[1]
    buf = torch.empty(b - a, cols, dtype=DTYPES[dtype])
    filled = 0
    for pc in tg.pieces:
        lo, hi = max(a, pc.dst_row), min(b, pc.dst_row + pc.r1 - pc.r0)
        if lo >= hi:
            continue
        got = reader.rows(sources[pc.src], pc.r0 + lo - pc.dst_row, pc.r0 + hi - pc.dst_row)[:, pc.c0:pc.c1]
        refuse_nonfinite(got, sources[pc.src].name, sources[pc.src].file, tg.name)
        buf[lo - a:hi - a, pc.dst_col:pc.dst_col + pc.c1 - pc.c0] = got
        filled += got.numel()
        del got  # one source slab alive at a time
    if filled != buf.numel():
        raise ConversionError(f"internal error: the pieces of {tg.name!r} do not tile rows {a}..{b}")
    return buf


def _write_target(w: StreamWriter, tg: Target, dtype: str, sources: Dict[str, TensorEntry], reader: RowReader,
                  bar) -> None:
    rows, cols = view2d(tg.shape)
    itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    widest = max([cols] + [sources[pc.src].row_elems for pc in tg.pieces])  # a column slice reads whole rows
    step = max(1, CHUNK_BYTES // (widest * itemsize))
    for a in range(0, rows, step):
        buf = assemble_rows(tg, dtype, sources, reader, a, min(rows, a + step))
        w.write(tg.name, buf)
        bar.update(buf.numel() * itemsize)
        del buf  # free before the next chunk's allocation (else two chunks live at once)


def write_plan(out_dir: Path, plan: Dict[str, List[Target]], sources: Dict[str, TensorEntry],
               progress: bool = True, desc: str = "convert") -> Dict[str, int]:
    """Write every file of `plan`; returns {file: tensor bytes}. Dtypes are checked for all files first."""
    dtypes = {f: [target_dtype(tg, sources) for tg in tgs] for f, tgs in plan.items()}
    sizes = {f: sum(view2d(tg.shape)[0] * view2d(tg.shape)[1] * torch.empty(0, dtype=DTYPES[dt]).element_size()
                    for tg, dt in zip(tgs, dtypes[f])) for f, tgs in plan.items()}
    reader = RowReader()
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        try:
            for file, targets in plan.items():
                specs = [(tg.name, dt, tg.shape) for tg, dt in zip(targets, dtypes[file])]
                w = StreamWriter(out_dir / file, specs)
                try:
                    for tg, dt in zip(targets, dtypes[file]):
                        _write_target(w, tg, dt, sources, reader, bar)
                    w.close()
                except BaseException:
                    w.abort()
                    raise
        finally:
            reader.close()
    return sizes


def _copy_small_files(src: Path, dst: Path) -> List[str]:
    """config.json, tokenizer and generation files: every regular file that is not a weight file or index."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX_FILE, META_FILE):
            shutil.copyfile(f, Path(dst) / f.name)
            copied.append(f.name)
    return copied


# ---------------------------------------------------------------------------------------------------------------
# the two directions, and loading a converted checkpoint into the learner's model
# ---------------------------------------------------------------------------------------------------------------
def hf_to_megatron(hf_dir, out_dir, *, tp: int = 1, ep: int = 1, pp: int = 1, progress: bool = True) -> Path:
    """Convert a HF Qwen3-MoE checkpoint into the per-rank Megatron layout for (tp, ep, pp); returns out_dir."""
    check_out(out_dir)
    hf_dir = Path(hf_dir)
    shape, found, hf_layout, index_meta = scan_hf(hf_dir)
    lay = Layout(tp, ep, pp)
    plan = plan_hf_to_megatron(shape, lay)
    with staged_output(out_dir) as stage:
        sizes = write_plan(stage, plan, found, progress, desc="hf-to-megatron")
        meta = {
            "format": FORMAT, "tp": tp, "ep": ep, "pp": pp, "hf_config": _read_config(hf_dir),
            "files": {f: [tg.name for tg in tgs] for f, tgs in plan.items()}, "bytes": sum(sizes.values()),
            "hf_layout": hf_layout, "hf_index_metadata": index_meta,
            "hf_files": _copy_small_files(hf_dir, stage),
        }
        (stage / META_FILE).write_text(json.dumps(meta, indent=1))  # last: its presence means "complete"
    return Path(out_dir)


def default_hf_layout(shape: Qwen3MoeShape, shard_bytes: int = HF_SHARD_BYTES, itemsize: int = 2) -> Dict[str, List[str]]:
    """Canonical tensor order cut into shards of about shard_bytes, named model-0000i-of-0000n.safetensors."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, shp in hf_shapes(shape).items():
        n = view2d(shp)[0] * view2d(shp)[1] * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    total = len(shards)
    return {f"model-{i + 1:05d}-of-{total:05d}.safetensors": names for i, names in enumerate(shards)}


def hf_plan_of_megatron(mg_dir: Path) -> Tuple[dict, Dict[str, List[Target]], Dict[str, TensorEntry], List[str]]:
    """(metadata, the HF files as targets reading the Megatron tensors, those tensors' entries, the small HF files
    to copy back) of a checkpoint written by hf_to_megatron; every header and listed file checked."""
    mg_dir = Path(mg_dir)
    meta, shape, plan, found = scan_megatron(mg_dir)
    layout = meta.get("hf_layout") or default_hf_layout(shape)
    shapes = hf_shapes(shape)
    listed = [n for names in layout.values() for n in names]
    if sorted(listed) != sorted(shapes):
        raise ConversionError(f"{mg_dir / META_FILE}: hf_layout does not list each Qwen3-MoE tensor exactly once")
    hf_plan = invert_plan(plan, shapes, layout)
    _check_replicas(plan, found)
    small = meta.get("hf_files") or []
    for name in small:
        if not (mg_dir / name).is_file():
            raise ConversionError(f"{mg_dir / name}: not found ({mg_dir / META_FILE} lists it among the Hugging Face "
                                  "files to copy back)")
    return meta, hf_plan, found, small


def _check_replicas(plan: Dict[str, List[Target]], found: Dict[str, TensorEntry]) -> None:
    """Replicas (norms and routers a TP rank holds a copy of) are not read back (invert_plan), but a rank loads its
    copy: one holding NaN or Inf stops the conversion as any tensor read does. Small tensors, read whole."""
    reader = RowReader()
    try:
        for file, targets in plan.items():
            for tg in targets:
                if tg.replica:
                    entry = found[f"{file}::{tg.name}"]
                    refuse_nonfinite(reader.rows(entry, 0, entry.rows), entry.name, entry.file)
    finally:
        reader.close()


def megatron_to_hf(mg_dir, out_dir, *, progress: bool = True) -> Path:
    """Convert a checkpoint written by hf_to_megatron back to HF sharded safetensors with an index."""
    check_out(out_dir)
    mg_dir = Path(mg_dir)
    meta, hf_plan, found, small = hf_plan_of_megatron(mg_dir)
    layout = {f: [tg.name for tg in tgs] for f, tgs in hf_plan.items()}
    with staged_output(out_dir) as stage:
        sizes = write_plan(stage, hf_plan, found, progress, desc="megatron-to-hf")
        for name in small:
            shutil.copyfile(mg_dir / name, stage / name)
        if not (stage / "config.json").exists():
            (stage / "config.json").write_text(json.dumps(meta["hf_config"], indent=2))
        index = {"metadata": {**(meta.get("hf_index_metadata") or {}), "total_size": sum(sizes.values())},
                 "weight_map": {n: f for f, names in layout.items() for n in names}}
        (stage / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return Path(out_dir)


def rank_files(meta: dict, tp_rank: int, pp_rank: int, ep_rank: int) -> List[str]:
    """The two files rank (tp_rank, pp_rank, ep_rank) loads."""
    return [dense_file(tp_rank, pp_rank), experts_file(pp_rank, ep_rank)]


def load_into_model(model: torch.nn.Module, mg_dir, *, tp_rank: Optional[int] = None, pp_rank: Optional[int] = None,
                    ep_rank: Optional[int] = None) -> List[str]:
    """Copy this rank's tensors into `model` (ranks default to Megatron's parallel state); returns the names.

    The checkpoint's tp/ep/pp must be the model's; every parameter must be covered (`_extra_state` aside) and finite
    (a NaN or Inf would reach the first step as a diverged run; `minite.ops.first_nonfinite`: one host read).
    Call it before building the optimizer (or reload the optimizer's fp32 master copies afterwards, e.g. Megatron's
    `optimizer.reload_model_params()`): a BF16 learner's optimizer steps from masters copied at its construction.
    """
    mg_dir = Path(mg_dir)
    meta = read_meta(mg_dir)
    if tp_rank is None or pp_rank is None or ep_rank is None:
        from megatron.core import parallel_state as ps
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size())
        if have != (meta["tp"], meta["ep"], meta["pp"]):
            raise ConversionError(f"{mg_dir}: written for (tp, ep, pp)=({meta['tp']}, {meta['ep']}, {meta['pp']}), "
                                  f"the model runs {have}; convert again with matching --tp/--ep/--pp")
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
    state = model.state_dict()
    loaded, reader = {}, RowReader()  # name -> the file it came from
    try:
        for file in rank_files(meta, tp_rank, pp_rank, ep_rank):
            for name, entry in read_header(mg_dir / file).items():
                if name not in state:
                    raise ConversionError(f"extra tensor {name!r} in {entry.file}: the model has no such parameter")
                if tuple(state[name].shape) != entry.shape:
                    raise ConversionError(f"tensor {name!r} in {entry.file}: shape {list(entry.shape)}, the model's "
                                          f"is {list(state[name].shape)}")
                with torch.no_grad():
                    state[name].copy_(reader.rows(entry, 0, entry.rows).view(entry.shape))
                loaded[name] = entry.file
    finally:
        reader.close()
    bad = first_nonfinite({n: state[n] for n in loaded if state[n].is_floating_point()})
    if bad is not None:
        raise ConversionError(f"tensor {bad!r} in {loaded[bad]} holds NaN or Inf: not weights to start a run from "
                              "(convert a finite checkpoint)")
    missing = [n for n, v in state.items() if torch.is_tensor(v) and n not in loaded and "_extra_state" not in n]
    if missing:
        raise ConversionError(f"{mg_dir}: missing tensors for this rank: {missing[:10]}")
    return list(loaded)


# ---------------------------------------------------------------------------------------------------------------
# entry points of `minite convert hf-to-megatron` / `megatron-to-hf` (arguments: minite/convert/cli.py)
# ---------------------------------------------------------------------------------------------------------------
def _cli(fn, *args, **kwargs) -> int:
    """Run one direction and name what it wrote; a ConversionError goes on to minite/cli.py (one line, status 2)."""
    print(f"wrote {fn(*args, **kwargs)}")
    return 0


def run_hf_to_megatron(args) -> int:
    return _cli(hf_to_megatron, args.hf, args.out, tp=args.tp, ep=args.ep, pp=args.pp, progress=not args.no_progress)


def run_megatron_to_hf(args) -> int:
    return _cli(megatron_to_hf, args.megatron, args.out, progress=not args.no_progress)
