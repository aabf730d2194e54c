#!/usr/bin/env bash
# Builds a folder from which SGLang 0.5.23's released allocator classes import on a machine
# without sglang and without network (the GPU image: Python 3.12, torch, numpy, triton):
#
#   bash benchmarks/sglang_bundle.sh [DEST] [PYVER]      # defaults: .sglang_py312 3.12
#
# DEST holds the .py files of the sglang wheel for PYVER listed in FILES, the manylinux
# x86_64 wheels for PYVER of the packages those imports need, unpacked and trimmed (about
# 38 MB), and VERSION: the wheels' names and sha256. torch, numpy, triton and their
# dependencies are left to the target image. APPEND DEST to sys.path
# (sglang_oracle.use_bundle), so the image's own packages win. Needs python3 and a pip
# that reaches the package index (any Python: --python-version picks the wheels).
set -euo pipefail
DEST=${1:-.sglang_py312}
PYVER=${2:-3.12}
PIP=${PIP:-pip}
SGLANG=sglang==0.5.23
# Pinned to the versions the recipe was checked with (the 3.11 venv's).
DEPS=(aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anyio==4.16.0 attrs==26.1.0
      certifi==2026.10.19.post1 charset-normalizer==3.5.3 frozenlist==1.8.0 idna==3.20
      ipython==9.18.1 msgspec==0.23.0 multidict==7.2.1 orjson==3.13.0 packaging==26.4
      pillow==13.0.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4
      pydantic_core==2.50.5 Pygments==2.21.0 pyzmq==27.3.0 requests==2.34.2
      starlette==1.10.0 tqdm==4.70.1 traitlets==5.16.1 typing-inspection==0.4.5
      urllib3==2.8.0 yarl==1.25.1)
# The sglang .py files kept: every module that `import sglang.srt.mem_cache.allocator` and
# `.allocator.swa` load (traced on CPU torch and on a torch reporting CUDA) and every .py of
# mem_cache/, mem_cache/allocator/ and kernels/ops/memory/ (the methods import lazily there).
FILES="$(dirname "$0")/sglang_bundle_files.txt"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
GET=("$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYVER")
for p in 2014 _2_17 _2_24 _2_26 _2_27 _2_28; do GET+=(--platform "manylinux${p}_x86_64"); done
# sglang's wheel is tagged manylinux_2_34; only its .py files are used.
"${GET[@]}" --platform manylinux_2_34_x86_64 -d "$WORK/sglang" "$SGLANG"
"${GET[@]}" -d "$WORK/deps" "${DEPS[@]}"

rm -rf "$DEST"
mkdir -p "$DEST"
python3 - "$WORK" "$DEST" "$PYVER" "$FILES" <<'EOF'
import hashlib, os, pathlib, sys, zipfile
work, dest, pyver = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
keep = set(pathlib.Path(sys.argv[4]).read_text().split())
tag = "cp" + pyver.replace(".", "")
# Trims (the allocator never reaches them):
# - sources, stubs and tests;
# - Pillow: only PIL/_imaging and the bundled libraries it links (PIL.Image imports);
# - Cython speedups that have pure-Python fallbacks the packages pick when they are absent.
SOURCES = (".c", ".pyx", ".pxd", ".pyi", ".h", ".cpp")
PIL_LIBS = ("libtiff", "libjpeg", "libopenjp2", "libxcb", "libXau", "libzstd", "liblzma")
SPEEDUPS = ("aiohttp/", "multidict/", "propcache/", "frozenlist/", "yarl/")

def sha(p):
  return hashlib.sha256(p.read_bytes()).hexdigest()

def skip(name):
  parts = name.split("/")
  base = parts[-1]
  if "__pycache__" in parts or "tests" in parts[1:] or name.endswith(SOURCES):
    return True
  if ".dist-info/" in name:
    return not base in ("METADATA", "WHEEL")
  if name.startswith("PIL/") and ".so" in base:
    return not base.startswith("_imaging.")
  if name.startswith("pillow.libs/"):
    return not base.startswith(PIL_LIBS)
  return name.startswith(SPEEDUPS) and base.endswith(".so")

(whl,) = (work / "sglang").glob("*.whl")
with zipfile.ZipFile(whl) as z:
  missing = keep - set(z.namelist())
  assert not missing, f"not in {whl.name}: {sorted(missing)}"
  z.extractall(dest, sorted(keep))
lines = [f"{whl.name} {sha(whl)} ({len(keep)} .py files)"]
for w in sorted((work / "deps").glob("*.whl")):
  wtags = w.name[:-4].split("-")[-3:]
  if wtags[2] != "any":
    assert (wtags[0] == tag or wtags[1] == "abi3") and "x86_64" in wtags[2], w.name
  with zipfile.ZipFile(w) as z:
    z.extractall(dest, [n for n in z.namelist() if not skip(n)])
  lines.append(f"{w.name} {sha(w)}")
(dest / "VERSION").write_text("\n".join(lines) + "\n")
EOF
du -sh "$DEST"
