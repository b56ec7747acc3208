"""``python -m flashmask.run COMMAND [ARGS...]``: run a command with the ``"flashmask"``
attention backend registered.

A command-line tool that builds the model itself (``trl sft``, a training script, a serving
module) never imports flashmask, so transformers rejects ``attn_implementation="flashmask"``
as not supported. transformers 5.x has no plugin lookup (entry points) for third-party
attention backends, only its own names and Hub kernels (which need the ``kernels`` package
and a download). This launcher imports :mod:`flashmask.integrations.transformers` (which
registers the backend) and then runs the command in the same process::

    python -m flashmask.run trl sft --model_name_or_path ... --attn_implementation flashmask
    python -m flashmask.run train.py --attn flashmask          # a Python file
    python -m flashmask.run -m my_package.train --epochs 1       # a module, as python -m runs it
    torchrun --nproc-per-node 8 -m flashmask.run train.py ...    # every worker registers it
    accelerate launch -m flashmask.run train.py ...

``COMMAND`` is ``-m MODULE``; a Python file (a name ending in ``.py`` or containing a path
separator, or an existing file that no console script of that name shadows); or the name of a
console script installed in this environment (``trl``, ``accelerate``, ..., found through the
``console_scripts`` entry points, so the script's own function runs, not a new interpreter).
The command sees ``sys.argv`` as it would when run directly (``[COMMAND, *ARGS]``) and, for a
file or module, runs as ``__main__``. Launchers that start worker processes must start the
launcher in every worker (the ``torchrun`` and ``accelerate launch`` lines above): a backend
registered in the parent process does not reach its children.

The exit status is the command's (``sys.exit`` codes and console-script return values, as
Python maps them: ``None`` is 0, a message is printed and gives 1); 2 for a usage error.
"""

from __future__ import annotations

import importlib.metadata
import os
import runpy
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]

_USAGE = """usage: python -m flashmask.run COMMAND [ARGS...]

Run COMMAND with the "flashmask" attention backend registered for transformers, in this
process. COMMAND is one of:
  -m MODULE      a module, run as python -m MODULE runs it
  PATH.py        a Python file, run as python PATH.py runs it
  NAME           a console script of this environment (e.g. trl, accelerate)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Register the backend, then run the command ``argv`` (default ``sys.argv[1:]``).

    Args:
        argv: ``[COMMAND, *ARGS]`` as described in the module docstring.

    Returns:
        The command's exit status; 2 when ``argv`` names no command that can be run. While the
        command runs ``sys.argv`` is ``[COMMAND, *ARGS]`` (``[MODULE, *ARGS]`` for ``-m``);
        both it and ``sys.path`` are restored afterwards.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "-m" and len(argv) < 2:
        print(_USAGE + "\nerror: -m needs a MODULE\n", end="", file=sys.stderr)
        return 2
    try:
        import flashmask.integrations.transformers  # noqa: F401  (registers "flashmask")
    except ImportError as error:
        print(f"flashmask.run: cannot register the transformers backend: {error}", file=sys.stderr)
        return 2

    saved_argv, saved_path = sys.argv, sys.path[:]  # the command gets a new argv list
    try:
        if argv[0] == "-m":
            module, args = argv[1], argv[2:]
            sys.argv = [module, *args]
            return _status(lambda: _run_module(module))
        command, args = argv[0], argv[1:]
        script = None if _is_path(command) else _console_script(command)
        if script is not None:
            sys.argv = [command, *args]
            return _status(script)
        if not os.path.isfile(command):
            print(
                f"flashmask.run: {command!r} is neither a Python file nor a console script "
                "installed in this environment (use -m MODULE to run a module)",
                file=sys.stderr,
            )
            return 2
        sys.argv = [command, *args]
        # As python FILE does: the file's directory comes first on the import path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(command)))
        return _status(lambda: _run_file(command))
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _is_path(command: str) -> bool:
    """Whether ``command`` can only be a file (a console script name has neither)."""
    return command.endswith(".py") or os.sep in command or (os.altsep or os.sep) in command


def _console_script(name: str) -> Callable[[], object] | None:
    """The function of the console script ``name`` installed in this environment, if any."""
    for entry_point in importlib.metadata.entry_points(group="console_scripts", name=name):
        return entry_point.load()
    return None


def _run_module(module: str) -> None:
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _run_file(path: str) -> None:
    runpy.run_path(path, run_name="__main__")


def _status(run: Callable[[], object]) -> int:
    """Run ``run()`` and return the exit status Python gives its result or its ``SystemExit``
    code (``None``: 0; an int: itself; anything else: printed to stderr, 1)."""
    try:
        code = run()
    except SystemExit as exit_:
        code = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
