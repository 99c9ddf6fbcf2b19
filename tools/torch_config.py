#!/usr/bin/env python3
"""Describe a LibTorch installation for Meson (key=value lines on stdout).

Either ask an installed `torch` package (the project venv's by default) or read a plain
LibTorch prefix (--prefix: a directory with include/, lib/ and share/cmake/Torch/).
The C++ ABI flag is taken from what the installation says, never guessed.

It also builds a filtered include directory (--filtered-include DIR): symlinks to every
entry of LibTorch's include/ except its bundled `fmt`, so that exactly one fmt (the one
dtensor links) is visible to the compiler.
"""
import argparse
import os
import re
import sys


def from_python():
    import torch  # noqa: PLC0415

    root = os.path.dirname(torch.__file__)
    site = os.path.dirname(root)
    info = {
        "version": torch.__version__.split("+")[0],
        "include": os.path.join(root, "include"),
        "libdir": os.path.join(root, "lib"),
        "cxx11_abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "cuda_version": torch.version.cuda or "",
    }
    info.update(nvidia_dirs(site))
    return info


def nvidia_dirs(site):
    """The CUDA wheels' libraries and headers (site-packages/nvidia/*/lib, include) beside
    a torch package: libtorch_cuda finds them through its RUNPATH, the linker needs them."""
    nvidia = os.path.join(site, "nvidia")
    if not os.path.isdir(nvidia):
        return {}
    libdirs, incdirs = [], []
    for name in sorted(os.listdir(nvidia)):
        for sub, acc in (("lib", libdirs), ("include", incdirs)):
            d = os.path.join(nvidia, name, sub)
            if os.path.isdir(d):
                acc.append(d)
    return {"nvidia_libdirs": ":".join(libdirs), "nvidia_incdirs": ":".join(incdirs)}


def abi_of_library(libdir):
    """[Note: the ABI read from the library]
    TorchConfig.cmake stopped naming _GLIBCXX_USE_CXX11_ABI once LibTorch was built with
    the new ABI only (2.11 has no TORCH_CXX_FLAGS): then the library itself says which ABI
    its std::string symbols use (the new one mangles them under std::__cxx11)."""
    lib = os.path.join(libdir, "libc10.so")
    if not os.path.isfile(lib):
        sys.exit(f"torch_config: no _GLIBCXX_USE_CXX11_ABI in TorchConfig.cmake and no {lib}")
    with open(lib, "rb") as f:
        return "1" if b"St7__cxx11" in f.read() else "0"


def from_prefix(prefix):
    cfg = os.path.join(prefix, "share", "cmake", "Torch", "TorchConfig.cmake")
    if not os.path.isfile(cfg):
        sys.exit(f"torch_config: {cfg} not found: is {prefix} a LibTorch prefix?")
    text = open(cfg, encoding="utf-8").read()
    m = re.search(r"_GLIBCXX_USE_CXX11_ABI=(\d)", text)
    libdir = os.path.join(prefix, "lib")
    version = ""
    vfile = os.path.join(prefix, "build-version")
    if os.path.isfile(vfile):
        version = open(vfile, encoding="utf-8").read().strip().split("+")[0]
    else:
        vcfg = os.path.join(prefix, "share", "cmake", "Torch", "TorchConfigVersion.cmake")
        if os.path.isfile(vcfg):
            mv = re.search(r'PACKAGE_VERSION "([0-9.]+)', open(vcfg, encoding="utf-8").read())
            version = mv.group(1) if mv else ""
    info = {
        "version": version,
        "include": os.path.join(prefix, "include"),
        "libdir": libdir,
        "cxx11_abi": m.group(1) if m else abi_of_library(libdir),
        "cuda_version": "",
    }
    # A wheel's torch/ directory is a prefix too; its CUDA libraries lie beside it.
    info.update(nvidia_dirs(os.path.dirname(os.path.abspath(prefix))))
    return info


def filtered_include(src, dst):
    os.makedirs(dst, exist_ok=True)
    wanted = {e for e in os.listdir(src) if e != "fmt"}
    for e in os.listdir(dst):
        if e not in wanted:
            os.unlink(os.path.join(dst, e))
    for e in wanted:
        link = os.path.join(dst, e)
        target = os.path.join(src, e)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default="")
    ap.add_argument("--filtered-include", default="")
    a = ap.parse_args()
    info = from_prefix(a.prefix) if a.prefix else from_python()
    if a.filtered_include:
        filtered_include(info["include"], a.filtered_include)
        info["filtered_include"] = a.filtered_include
    for k, v in info.items():
        print(f"{k}={v}")


if __name__ == "__main__":
    main()
