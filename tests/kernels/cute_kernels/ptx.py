"""The PTX of one compiled CuTe kernel variant and ptxas's spill report of it for sm_90a,
without a GPU (shared by the CuTe compile tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def compiled_ptx(tmp_path: Path, code: str) -> str:
    """The PTX of the one kernel that Python ``code`` compiles, in a process of its own (CuTe
    DSL dumps the PTX of every compile of a process; the repository root is importable)."""
    tmp_path.mkdir(parents=True)
    env = {**os.environ, "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DISABLE_FILE_CACHING": "1"}
    env["CUTE_DSL_DUMP_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True)
    (ptx,) = tmp_path.glob("*.ptx")
    return ptx.read_text()


def spill_bytes(tmp_path: Path, ptx: str) -> int:
    """Spill stores plus loads, in bytes, of ``ptx`` assembled for sm_90a by the Hopper
    ``ptxas`` that Triton ships (beside the one it picks for newer GPUs)."""
    from triton.backends.nvidia import compiler

    ptxas = str(Path(compiler.get_ptxas(90).path).with_name("ptxas"))
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    run = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "kernel.cubin")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.findall(r"(\d+) bytes spill (?:stores|loads)", run.stderr)
    return sum(int(n) for n in found)
