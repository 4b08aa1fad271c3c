# Sourced by the GPU scripts: puts NVRTC and cuBLAS on LD_LIBRARY_PATH.
# NVRTC and cuBLAS may live in the CUDA toolkit or in PyTorch's nvidia wheels.
extra=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
dirs = set()
for r in roots:
    for lib in glob.glob(os.path.join(r, "**", "lib"), recursive=True):
        if glob.glob(os.path.join(lib, "libnvrtc.so*")) or glob.glob(os.path.join(lib, "libcublas*.so*")):
            dirs.add(lib)
print(":".join(sorted(dirs)))
PY
)
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && extra="$extra:$d"
done
export LD_LIBRARY_PATH="${extra#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
