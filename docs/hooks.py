"""MkDocs hook: adds the reference pages generated from the code (reference_pages.py, beside
this file) to the site at build time, so the configuration keys, the commands and the protocol's
messages in the docs are always the code's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    sys.path.insert(0, str(Path(__file__).parent))
    import reference_pages as reference

    for path, func in reference.PAGES.items():
        files.append(File.generated(config, path, content=getattr(reference, func)()))
    return files
