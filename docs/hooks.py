"""MkDocs hook: adds the reference pages generated from the code (fedseq.server.reference) to
the site at build time, so the configuration keys, the commands and the protocol's messages in
the docs are always the code's."""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    from fedseq.server import reference

    for path, func in reference.PAGES.items():
        files.append(File.generated(config, path, content=getattr(reference, func)()))
    return files
