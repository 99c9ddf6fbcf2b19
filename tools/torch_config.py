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
    nvidia = os.path.join(site, "nvidia")
    if os.path.isdir(nvidia):
        libdirs, incdirs = [], []
        for name in sorted(os.listdir(nvidia)):
            for sub, acc in (("lib", libdirs), ("include", incdirs)):
                d = os.path.join(nvidia, name, sub)
                if os.path.isdir(d):
                    acc.append(d)
        info["nvidia_libdirs"] = ":".join(libdirs)
        info["nvidia_incdirs"] = ":".join(incdirs)
    return info


def from_prefix(prefix):
    cfg = os.path.join(prefix, "share", "cmake", "Torch", "TorchConfig.cmake")
    if not os.path.isfile(cfg):
        sys.exit(f"torch_config: {cfg} not found: is {prefix} a LibTorch prefix?")
    text = open(cfg, encoding="utf-8").read()
    m = re.search(r"_GLIBCXX_USE_CXX11_ABI=(\d)", text)
    if not m:
        sys.exit(f"torch_config: no _GLIBCXX_USE_CXX11_ABI in {cfg}")
    version = ""
    vfile = os.path.join(prefix, "build-version")
    if os.path.isfile(vfile):
        version = open(vfile, encoding="utf-8").read().strip().split("+")[0]
    else:
        vcfg = os.path.join(prefix, "share", "cmake", "Torch", "TorchConfigVersion.cmake")
        if os.path.isfile(vcfg):
            mv = re.search(r'PACKAGE_VERSION "([0-9.]+)', open(vcfg, encoding="utf-8").read())
            version = mv.group(1) if mv else ""
    return {
        "version": version,
        "include": os.path.join(prefix, "include"),
        "libdir": os.path.join(prefix, "lib"),
        "cxx11_abi": m.group(1),
        "cuda_version": "",
    }


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
