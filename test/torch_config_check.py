"""tools/torch_config.py on a LibTorch prefix, judged by the torch package itself.

The venv's torch/ directory is given as a plain prefix (-Dlibtorch=): its TorchConfig.cmake
names no _GLIBCXX_USE_CXX11_ABI (LibTorch 2.11 and later), so the ABI is read from
libc10.so ([Note: the ABI read from the library]); it must be what torch._C says, and the
CUDA wheels' directories beside the package must be those the python mode finds.
Usage: python torch_config_check.py TORCH_CONFIG_PY
"""
import os
import subprocess
import sys

import torch


def describe(*args):
    out = subprocess.run([sys.executable, sys.argv[1], *args], check=True, capture_output=True,
                         text=True).stdout
    return dict(line.split("=", 1) for line in out.strip().splitlines())


prefix = os.path.dirname(torch.__file__)
by_prefix = describe("--prefix", prefix)
by_python = describe()
want_abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
checks = {
    "cxx11_abi (prefix) == torch._C": (by_prefix["cxx11_abi"], want_abi),
    "version (prefix) == torch.__version__": (by_prefix["version"], torch.__version__.split("+")[0]),
    "libdir (prefix) == python mode": (os.path.realpath(by_prefix["libdir"]),
                                       os.path.realpath(by_python["libdir"])),
    "nvidia_libdirs (prefix) == python mode": (by_prefix.get("nvidia_libdirs", ""),
                                               by_python.get("nvidia_libdirs", "")),
}
failed = [f"{name}: {got!r} != {want!r}" for name, (got, want) in checks.items() if got != want]
for line in failed:
    print("FAIL", line)
print(f"torch_config --prefix {prefix}: cxx11_abi={by_prefix['cxx11_abi']}, "
      f"{len(by_prefix.get('nvidia_libdirs', '').split(':'))} nvidia dirs; "
      f"{len(checks) - len(failed)} of {len(checks)} checks pass")
sys.exit(1 if failed else 0)
