"""tools/README.md says how to run every script of tools/, in the README's venv with ../shared/corpus
(no machine-specific paths), and stays a how-to: the numbers go to tools/RESULTS.md, what they decided
to docs/decisions/."""
import re

import pytest

from tests.kits import ROOT

TEXT = (ROOT / "tools" / "README.md").read_text()


def test_no_absolute_machine_paths():
    assert not re.findall(r"(?<![\w.~])/(?:tmp|work|root|home|Users)/\S*", TEXT)


def test_setup_uses_the_readme_venv_and_the_shared_corpus_script():
    assert ". .venv/bin/activate" in TEXT and ". .venv/bin/activate" in (ROOT / "README.md").read_text()
    assert "bash ../shared/corpus/make_corpus.sh ~/.cache/qp-corpus" in TEXT


def test_every_tools_command_names_an_existing_script():
    scripts = re.findall(r"^python (tools/\S+\.py)", TEXT, re.M)
    assert scripts and all((ROOT / s).is_file() for s in scripts)


@pytest.mark.skipif(not (ROOT.parent / "shared" / "corpus").is_dir(), reason="no shared corpus folder beside the checkout")
def test_corpus_script_is_where_the_readme_says():
    assert (ROOT.parent / "shared" / "corpus" / "make_corpus.sh").is_file()


def test_every_tools_script_is_described():
    scripts = sorted(p.name for p in (ROOT / "tools").glob("*.py"))
    missing = [name for name in scripts if name not in TEXT]
    assert not missing, f"tools/README.md has no section naming {missing}"


def test_stays_a_how_to():
    """A page of how to run each benchmark, not a lab notebook: the journal it replaced had grown to
    2,699 lines of dated runs that hid how to run anything."""
    assert len(TEXT.splitlines()) <= 300
    assert "RESULTS.md" in TEXT and (ROOT / "tools" / "RESULTS.md").is_file()
