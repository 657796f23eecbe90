#!/usr/bin/env bash
# Builds .sglwhl/ (git-ignored): the wheels tools/sglang_gpu_probe.sh installs on a GPU machine that reaches no
# registry. Run here, where pip reaches one: `bash tools/sglang_gpu_bundle.sh [OUT_DIR] [PYTHON_VERSION]` (defaults
# .sglwhl and 3.12, the GPU image's Python; another version builds the same set for a dry run on this machine's
# Python). Then carry `.sglwhl` with the call.
#   - sglang 0.5.23, cp312 (the GPU image's Python), minus its four Rust extension modules sglang/srt/rust_extensions/
#     _{server,grpc,bench,multimodal}.*.so (18 of the wheel's 39 MB; the HTTP/gRPC servers,
#     benchmarks and multimodal processors load them on demand; the offline engine on CPU never imported them);
#   - tools/sglang_gpu_wheels.txt: the dependencies the GPU image lacks, and megatron-core.
# Not carried: sglang-kernel (535 MB, built for torch 2.14), flashinfer, torch, triton (the image's 2.11 / 3.6).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.sglwhl}
PYV=${2:-3.12}
rm -rf "$OUT" && mkdir -p "$OUT"
PLAT=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
DL=(python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYV"
    --implementation cp "${PLAT[@]}" -d "$OUT")
"${DL[@]}" -r tools/sglang_gpu_wheels.txt
"${DL[@]}" "sglang==0.5.23"
python3 - "$OUT" <<'PY'
"""Drop the Rust extensions the offline engine does not load from the sglang wheel (and their RECORD lines)."""
import pathlib, re, sys, zipfile
out = pathlib.Path(sys.argv[1])
whl = next(out.glob("sglang-0.5.23-*.whl"))
drop = re.compile(r"^sglang/srt/rust_extensions/_(server|grpc|bench|multimodal)\.[^/]*\.so$")
tmp = whl.with_suffix(".tmp")
with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    gone = [i.filename for i in src.infolist() if drop.match(i.filename)]
    for info in src.infolist():
        if info.filename in gone:
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(keepends=True) if l.split(b",")[0].decode() not in gone)
        dst.writestr(info, data)
tmp.replace(whl)
print("sglang wheel: removed", ", ".join(g.rsplit("/", 1)[1] for g in gone))
PY
ls "$OUT" | wc -l | xargs echo "wheels:"
du -sh "$OUT"
