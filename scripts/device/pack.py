"""Prepare the wheels a lent GPU machine lacks, sized for the device tool (one call carries at most 64 MiB).

    python scripts/device/pack.py        # writes .device/a and .device/b (ignored by git)

The GPU machine reaches no package registry and has Python 3.12 with torch, onnx, onnxruntime, matplotlib,
psutil and cloudpickle, but no TVM. apache-tvm's wheel is ~100 MB, over one call's limit, so it is split in
two: .device/a travels with the first call (scripts/device/stage.sh), .device/b with the second
(scripts/device/run_gpu.sh), which joins the halves, installs and runs ``python -m tvmdm.bench.gpu_run``. The pins
are read from pyproject.toml so the GPU runs the versions CI tests.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tomllib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WANTED = ("apache-tvm", "apache-tvm-ffi", "xgboost")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def pins() -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    found = {}
    for dep in deps:
        name, version = re.match(r"([A-Za-z0-9_.-]+)==([^;\s]+)", dep).groups()
        if name in WANTED:
            # xgboost's default wheel bundles CUDA (130 MB); the CPU build has the same API for the cost model.
            found[name] = f"{'xgboost-cpu' if name == 'xgboost' else name}=={version}"
    missing = set(WANTED) - set(found)
    if missing:
        sys.exit(f"pyproject.toml pins none of {sorted(missing)}")
    return list(found.values())


def main() -> int:
    exclude = os.path.join(ROOT, ".git", "info", "exclude")
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    if "/.device/" not in (open(exclude).read().split() if os.path.exists(exclude) else []):
        with open(exclude, "a") as f:
            f.write("/.device/\n")
    device = os.path.join(ROOT, ".device")
    shutil.rmtree(device, ignore_errors=True)
    wheels, half_a, half_b = (os.path.join(device, d) for d in ("wheels", "a", "b"))
    for d in (wheels, half_a, half_b):
        os.makedirs(d)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", wheels, *pins()], check=True)
    (tvm,) = glob.glob(os.path.join(wheels, "apache_tvm-*.whl"))
    with open(tvm, "rb") as f:
        data = f.read()
    middle = len(data) // 2
    with open(os.path.join(half_a, "tvm.whl.part0"), "wb") as f:
        f.write(data[:middle])
    with open(os.path.join(half_b, "tvm.whl.part1"), "wb") as f:
        f.write(data[middle:])
    with open(os.path.join(half_b, "tvm.whl.name"), "w") as f:
        f.write(os.path.basename(tvm) + "\n")
    for wheel in glob.glob(os.path.join(wheels, "*.whl")):
        if wheel != tvm:
            shutil.copy(wheel, half_b)
    shutil.rmtree(wheels)
    for d in (half_a, half_b):
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"{os.path.relpath(d, ROOT)}: {size / 2**20:.1f} MiB ({', '.join(sorted(os.listdir(d)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
