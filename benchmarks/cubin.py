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


def compile_gluon_sm90(kernel, signature: dict[str, str], constexprs: dict, options: dict):
    """Compile a Gluon kernel for sm_90 without a GPU. ``signature`` maps the runtime parameters
    to their types (``"*bf16"``, ``"i32"``, ``"tensordesc<...>"``), ``constexprs`` the
    constexpr parameters to their values, ``options`` are the launch options (``num_warps``,
    ``maxnreg``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [p.name for p in kernel.params]
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    indexed = {(names.index(name),): value for name, value in constexprs.items()}
    target = GPUTarget("cuda", 90, 32)
    parsed = make_backend(target).parse_options(options)
    source = GluonASTSource(kernel, signature, indexed, {})
    return triton.compile(source, target=target, options=parsed.__dict__)


def warp_specialized_report(compiled, opcodes: tuple[str, ...]) -> dict:
    """What a warp-specialised kernel's compile says: warps, registers per thread at launch,
    spill bytes, shared memory (KB), the distinct ``setmaxnreg`` instructions its partitions
    execute, and the count of each opcode in ``opcodes``."""
    dump = inspect_cubin(compiled, opcodes)
    ptx = compiled.asm["ptx"]
    return {
        "warps": compiled.metadata.num_warps,
        "registers": dump["registers"],
        "spill_bytes": dump["local_bytes"],
        "shared_kb": compiled.metadata.shared / 1024,
        "setmaxnreg": sorted(
            {" ".join(line.split()[:2]) for line in ptx.splitlines() if "setmaxnreg" in line}
        ),
        **{op: dump[op] for op in opcodes},
    }
