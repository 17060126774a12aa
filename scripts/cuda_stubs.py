"""Make the CUDA build of torch import on a machine without the NVIDIA wheels.

PyPI only offers the CUDA build of torch for Linux x86_64. Its shared libraries
list the NVIDIA libraries (libcudart.so.12, libcublas.so.12, ...) as DT_NEEDED,
and those come from about 2.8 GB of ``nvidia-*`` wheels. The test environments
that run such a torch on the CPU (``scripts/setup_xla.sh``: torch_xla;
``scripts/setup_torch_matrix.sh``: the oldest and newest torch nbaccel claims)
never call them, so instead of installing them this script builds one tiny stub library per missing
NVIDIA library: same soname, same symbol versions, every referenced function
defined and returning an error code (100, ``cudaErrorNoDevice`` for the CUDA
runtime), so ``torch.cuda.is_available()`` is simply False.

The stubs go into ``torch/lib`` (on the libraries' ``$ORIGIN`` RPATH, searched
after the ``nvidia/*/lib`` folders, so real NVIDIA wheels installed later still
win) and are listed in ``torch/lib/NBACCEL_CUDA_STUBS.txt``; ``--remove`` deletes
them again. The CUDA driver (libcuda.so.1) is never stubbed.

Needs ``cc`` (gcc or clang) and binutils (``nm``, ``readelf``). Exit status 0 on
success, 2 when a tool is missing or the build fails (the caller then installs
the real NVIDIA wheels instead).

Usage: python scripts/cuda_stubs.py TORCH_LIB_DIR [--remove]
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MANIFEST = "NBACCEL_CUDA_STUBS.txt"
NEVER_STUB = {"libcuda.so.1"}  # the driver: a real one must always be used when present
# Loaded only on demand (NVRTC / jiterator on a GPU); its needs are never loaded on CPU.
SKIP_LIBS = {"libcaffe2_nvrtc.so"}
ERROR_STRING = "CUDA is unavailable: this nbaccel test environment has CUDA stub libraries"


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _needed(lib: Path) -> list[str]:
    return re.findall(
        r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run("readelf", "-dW", str(lib))
    )


def _verneed(lib: Path) -> dict[str, str]:
    """Version name -> file (soname) that must define it, from .gnu.version_r."""
    out: dict[str, str] = {}
    current = None
    for line in _run("readelf", "-VW", str(lib)).splitlines():
        m = re.search(r"File: (\S+)\s+Cnt:", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Name: (\S+)\s+Flags:", line)
        if m and current is not None:
            out[m.group(1)] = current
    return out


def _symbols(lib: Path, *, defined: bool) -> list[tuple[str, str, str | None]]:
    """(type, name, version) of the dynamic symbols, defined or undefined."""
    flag = "--defined-only" if defined else "--undefined-only"
    rows = []
    for line in _run("nm", "-D", flag, str(lib)).splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        kind, sym = parts[-2], parts[-1]
        name, _, version = sym.partition("@")
        rows.append((kind, name, version.lstrip("@") or None))
    return rows


def _loadable(soname: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(soname)
    except OSError:
        return None


def _has_symbol(handles: list[ctypes.CDLL], name: str) -> bool:
    for handle in handles:
        try:
            handle[name]
            return True
        except AttributeError:
            continue
    return False


def _stem(soname: str) -> str:
    """libnvshmem_host.so.3 -> nvshmem, libcusparseLt.so.0 -> cusparselt."""
    return soname[3:].split(".")[0].lower().removesuffix("_host")


def plan(lib_dir: Path) -> dict[str, dict[str | None, set[str]]]:
    """Missing soname -> {version name or None: symbols the stub must define}."""
    libs = sorted(p for p in lib_dir.glob("*.so*") if p.is_file() and p.name not in SKIP_LIBS)
    present = {p.name for p in lib_dir.iterdir()}
    defined = {name for lib in libs for _, name, _ in _symbols(lib, defined=True)}
    process = ctypes.CDLL(None)  # the interpreter: libpython, libc, ...
    stubs: dict[str, dict[str | None, set[str]]] = {}
    for lib in libs:
        needed = _needed(lib)
        missing = [
            so
            for so in needed
            if so not in present and so not in NEVER_STUB and _loadable(so) is None
        ]
        if not missing:
            continue
        system = [h for h in (_loadable(so) for so in needed if so not in missing) if h]
        versions = _verneed(lib)
        for so in missing:
            stubs.setdefault(so, {})
        for kind, name, version in _symbols(lib, defined=False):
            if kind in ("w", "v"):  # weak references may stay unresolved
                continue
            if version is not None:
                owner = versions.get(version)
                if owner in missing:
                    stubs[owner].setdefault(version, set()).add(name)
                continue
            if name in defined or _has_symbol([process, *system], name):
                continue
            # Any stub among this library's dependencies resolves the symbol;
            # prefer the one whose name matches (nccl -> libnccl, ...).
            stem = name.lower()
            matches = [so for so in missing if _stem(so) in stem]
            owner = max(matches, key=len) if matches else missing[0]
            stubs[owner].setdefault(None, set()).add(name)
    return stubs


def _c_source(symbols: list[str]) -> str:
    lines = [f'static const char nbaccel_stub_msg[] = "{ERROR_STRING}";']
    for i, name in enumerate(symbols):
        if re.search(r"Error(String|Name)|GetString$", name):
            lines.append(f'const char *f{i}(void) __asm__("{name}");')
            lines.append(f"const char *f{i}(void) {{ return nbaccel_stub_msg; }}")
        else:
            lines.append(f'long f{i}(void) __asm__("{name}");')
            lines.append(f"long f{i}(void) {{ return 100; }}")
    return "\n".join(lines) + "\n"


def _version_script(groups: dict[str | None, set[str]]) -> str:
    nodes = []
    for version, names in sorted(groups.items(), key=lambda kv: kv[0] or ""):
        body = " ".join(f"{n};" for n in sorted(names))
        nodes.append(f"{version or 'NBACCEL_STUB'} {{ global: {body} local: *; }};")
    return "\n".join(nodes) + "\n"


def build(lib_dir: Path) -> list[str]:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None or shutil.which("nm") is None or shutil.which("readelf") is None:
        raise RuntimeError("needs a C compiler (cc) and binutils (nm, readelf)")
    stubs = plan(lib_dir)
    made = []
    with tempfile.TemporaryDirectory() as tmp:
        for soname, groups in sorted(stubs.items()):
            symbols = sorted({n for names in groups.values() for n in names})
            src = Path(tmp, f"{soname}.c")
            src.write_text(_c_source(symbols))
            cmd = [cc, "-shared", "-fPIC", "-O0", "-w", f"-Wl,-soname,{soname}"]
            if symbols:
                ver = Path(tmp, f"{soname}.map")
                ver.write_text(_version_script(groups))
                cmd.append(f"-Wl,--version-script={ver}")
            subprocess.run([*cmd, "-o", str(lib_dir / soname), str(src)], check=True)
            made.append(soname)
    (lib_dir / MANIFEST).write_text("".join(f"{so}\n" for so in made))
    return made


def remove(lib_dir: Path) -> None:
    manifest = lib_dir / MANIFEST
    if not manifest.exists():
        return
    for soname in manifest.read_text().split():
        (lib_dir / soname).unlink(missing_ok=True)
    manifest.unlink()


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    lib_dir = Path(argv[0])
    if "--remove" in argv[1:]:
        remove(lib_dir)
        return 0
    remove(lib_dir)
    try:
        made = build(lib_dir)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        remove(lib_dir)
        print(f"cuda_stubs: cannot build CUDA stubs: {exc}", file=sys.stderr)
        return 2
    print(f"cuda_stubs: {len(made)} stub libraries in {lib_dir}: {' '.join(made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
