"""The documentation site (mkdocs.yml): its reference pages are generated from the code, it builds
with --strict (a broken link or anchor, a missing page fails), and a real browser renders every
page with its navigation, its search box and no missing asset."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from conftest import ROOT, server_only

pytestmark = server_only
# the reference pages' generator lives beside the docs (docs/reference_pages.py), not in fedseq
sys.path.insert(0, str(ROOT / "docs"))


def _models() -> list[type[BaseModel]]:
    from reference_pages import _nested_tables, is_table

    from fedseq.client.settings import ClientSettings
    from fedseq.common.config import ExperimentConfig

    sections = [f.annotation for f in ExperimentConfig.model_fields.values() if is_table(f.annotation)]
    nested = [sub for s in sections for sub in _nested_tables(s)]
    return [ExperimentConfig, *sections, *nested, ClientSettings]


def test_every_configuration_key_has_a_description():
    missing = [f"{m.__name__}.{name}" for m in _models()
               for name, f in m.model_fields.items() if not (f.description or "").strip()]
    assert not missing, (f"configuration keys without a description (the generated reference "
                         f"would list them bare): {missing}; give each Field(description=...)")


def test_the_generated_references_name_every_key_option_and_message():
    import reference_pages as reference

    from fedseq.common.config import ExperimentConfig
    from fedseq.common.protocol import messages

    config = reference.config_page()
    for key, _ in reference.field_rows(ExperimentConfig):
        assert f"| `{key}` |" in config, key
    assert "| `fleet.devices` |" in config and "| `profile` |" in config  # a list of tables
    assert "| `state_dir` |" in config  # the device's settings

    cli = reference.cli_page()
    for heading in ("## `fedseq-sim`", "### `fedseq-server start`", "#### `fedseq data download`",
                    "#### `fedseq export mlflow`", "## `fedseq-client`"):
        assert heading in cli, heading
    for option in ("--workers-per-gpu", "--local-devices", "--link", "--paper", "--state-dir"):
        assert f"{option} " in cli or f"`{option}`" in cli, option

    pages = reference.messages_page()
    for name in ("Step", "UpdateHeader", "WeightsHeader", "Control", "DeviceStatus", "EvalResult"):
        assert f"## {name}\n" in pages, name
    assert f"protocol version {messages.PROTOCOL_VERSION}" in pages


def _build(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_site_builds_strictly_with_the_generated_reference(site):
    for page in ("reference/config", "reference/cli", "reference/protocol-messages"):
        html = (site / page / "index.html").read_text()
        assert "<table>" in html, page
    assert "train.over_select" in (site / "reference/config/index.html").read_text()
    assert (site / "search/search_index.json").stat().st_size > 10_000


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """--strict is what keeps the site honest: a page linking to a page or an anchor that does not
    exist fails the build (the docs copied, one link broken there)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    page = tmp_path / "docs/how-to/resume.md"
    page.write_text(page.read_text() + "\nSee [nothing](../no-such-page.md#nowhere).\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
                None)


class _Recorder(http.server.SimpleHTTPRequestHandler):
    missing: list[str] = []

    def send_error(self, code, message=None, explain=None):
        if code == 404:
            type(self).missing.append(self.path)
        super().send_error(code, message, explain)

    def log_message(self, *args):
        pass


@pytest.mark.slow("mkdocs builds the site, read by headless Chromium: 51 s on 2 cores")
def test_every_page_renders_in_a_headless_browser_without_a_missing_asset(site):
    if _chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium: .ci/run installs Debian's chromium for this check")
        pytest.skip("no Chromium here (apt-get install chromium)")
    handler = type("Handler", (_Recorder,), {"missing": []})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pages = sorted(p.parent.relative_to(site).as_posix() for p in site.glob("**/index.html")
                   if not p.relative_to(site).as_posix().startswith("results/"))
    assert len(pages) >= 20, pages
    try:
        for page in pages:
            url = f"http://127.0.0.1:{server.server_port}/{'' if page == '.' else page + '/'}"
            dom = subprocess.run(
                [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-dev-shm-usage", "--virtual-time-budget=3000", "--dump-dom", url],
                capture_output=True, text=True, timeout=120).stdout
            assert 'class="md-nav' in dom, f"{url}: no navigation in the rendered page"
            assert "md-search__input" in dom, f"{url}: no search box"
            assert "<h1" in dom, f"{url}: no title"
    finally:
        server.shutdown()
    assert not handler.missing, f"assets the pages asked for and the site lacks: {handler.missing}"


def test_generated_reference_text_is_not_read_as_html():
    """Newcomer II, finding 3: help and descriptions saying `OUT/<setting>/seed-<s>` were read as
    HTML (`<s>` struck the rest of the page through); outside code, generated text is escaped."""
    import re

    import reference_pages as reference

    cli = reference.cli_page()
    assert "OUT/&lt;setting&gt;/&lt;algorithm&gt;/seed-&lt;s&gt;" in cli
    for page in (cli, reference.config_page(), reference.messages_page()):
        prose, fenced = [], False
        for line in page.splitlines():
            fenced ^= line.startswith("```")
            if not fenced and not line.startswith("```"):
                prose.append(re.sub(r"`[^`]*`", "", line))
        tags = re.findall(r"<[A-Za-z/][^>]*>", "\n".join(prose))
        assert not tags, tags[:5]


def test_the_pages_the_help_names_are_the_sites_with_their_titles():
    """The commands' help names site pages by title and address (not repository paths); each
    is a page of mkdocs.yml's nav under that title, and every command ends its help with where
    the documentation is."""
    from typer.testing import CliRunner

    from fedseq.server.cli.commands import PAGES, server_app
    from fedseq.server.cli.tools import app as tools_app

    nav = (ROOT / "mkdocs.yml").read_text()
    for path, title in PAGES.items():
        assert f"- {title}: {path}" in nav, (path, title)
    runner = CliRunner()
    for app in (server_app, tools_app):
        text = " ".join(runner.invoke(app, ["--help"], terminal_width=200).output.split())
        assert "Documentation: the site built from docs/" in text
    started = runner.invoke(server_app, ["start", "--help"], terminal_width=200).output
    assert 'docs: "Rehearse a Wi-Fi testbed", rehearsal/' in " ".join(
        started.replace("│", " ").split())
