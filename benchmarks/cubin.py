"""Read a compiled Triton or Gluon kernel's cubin with the ``cuobjdump`` Triton bundles (no GPU):
registers per thread, local-memory (spill) bytes and static instruction counts."""

from __future__ import annotations

import re
import subprocess
import tempfile

import triton


def inspect_cubin(compiled, opcodes: tuple[str, ...]) -> dict[str, int]:
    """``registers``, ``local_bytes`` (spills plus stack) and, per opcode in ``opcodes`` (e.g.
    ``"HGMMA"``, ``"MUFU.EX2"``), how many instructions of it the SASS holds."""
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.check_output([cuobjdump, "-res-usage", f.name], text=True)
        sass = subprocess.check_output([cuobjdump, "-sass", f.name], text=True)
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", usage))
    return {
        "registers": int(fields.get("REG", -1)),
        "local_bytes": int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
        **{op: len(re.findall(r"\b" + re.escape(op) + r"\b", sass)) for op in opcodes},
    }
