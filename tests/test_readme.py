"""The README's quick start, run as a newcomer would: every shell block of it that shows an
answer (an `<!-- expect: ... -->` line after it) runs, in order, against the server its first
command starts (the default models, default settings), and its output must contain what the
README says it answers. The README cannot drift from what the server does."""

from __future__ import annotations

import re
import subprocess

from conftest import REPO

README = REPO / "README.md"
BLOCK = re.compile(r"```bash\n(.*?)```\n((?:<!-- expect: [^\n]* -->\n)*)", re.S)
EXPECT = re.compile(r"<!-- expect: (.*) -->")
README_URL = "http://127.0.0.1:8000"


def _quick_start() -> str:
    text = README.read_text()
    start = text.index("## Quick start")
    return text[start : text.index("\n## ", start + 1)]


def _blocks() -> list[tuple[str, list[str]]]:
    """(shell code, the strings its output must contain) for each block of the quick start."""
    return [(code, EXPECT.findall(tail)) for code, tail in BLOCK.findall(_quick_start())]


def test_the_quick_start_gives_the_answers_it_shows(default_server):
    runnable = [(code, expect) for code, expect in _blocks() if expect]
    assert len(runnable) >= 3  # an AR answer, a diffusion answer, a compacted session
    for code, expect in runnable:
        assert README_URL in code  # where the README's server listens
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code.replace(README_URL, default_server)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        for want in expect:
            assert want in out.stdout, (want, out.stdout[-2000:])


def test_the_quick_start_commands_are_the_real_ones():
    """Its two commands: install + serve (the console script pyproject installs), and the
    test command, the very line `.ci/run` runs."""
    commands = [code.strip() for code, expect in _blocks() if not expect]
    assert commands[0] == "pip install -e . && cdlm-serve"
    assert 'cdlm-serve = "cdlm_serve.server.cli:main"' in (REPO / "pyproject.toml").read_text()
    test_command = (
        "pip install -e '.[dev,kvpress]' && pip install --no-deps kvpress==0.5.5"
        " && python -m pytest -q"
    )
    assert test_command in commands
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_command


def test_every_link_of_the_readme_and_docs_leads_to_a_file():
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name}: {target}"
