"""The CuTe DSL kernel family for Hopper (needs the ``flashmask[cute]`` extra,
``nvidia-cutlass-dsl``); see ``docs/design.md``, "Kernel families and routing"."""
