"""Every "SPEC n" / "SPEC n.m" that a user can read (README.md, the command-line help
texts, the package's source, docstrings and messages) names a section of docs/spec.md,
and the docs pages (README and BENCHMARKS.md too) link only to files that exist."""
import argparse
import pathlib
import re

import pytest

from jax_kvalloc.tools import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGES = ("jax_kvalloc", "pallas_kernels", "torch_ref")

# "SPEC 4.2", "SPEC 4.2/4.3", "SPEC 4.2 and 4.3", "SPEC 2-8", "SPEC 10, 13": the first
# number after SPEC and each one joined to it by "/", ",", "-" or "and".
_CITE = re.compile(r"\bSPEC\s+(\d+(?:\.\d+)?(?:\s*(?:/|,|-|and)\s*\d+(?:\.\d+)?)*)")
_NUM = re.compile(r"\d+(?:\.\d+)?")


def cited(text: str):
  """The section numbers `text` cites, e.g. {"4.2", "4.3"} for "SPEC 4.2/4.3"."""
  out = set()
  for m in _CITE.finditer(text):
    nums = _NUM.findall(m.group(1))
    if "-" in m.group(1) and len(nums) == 2 and "." not in m.group(1):
      out.update(str(n) for n in range(int(nums[0]), int(nums[1]) + 1))
    else:
      out.update(nums)
  return out


def sections():
  """The section numbers docs/spec.md defines: "## 4. ..." -> "4", "### 4.2 ..." -> "4.2"."""
  text = (DOCS / "spec.md").read_text()
  return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def _help_texts(parser: argparse.ArgumentParser):
  """The --help text of `parser` and of every subcommand below it."""
  yield parser.format_help()
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      for sub in action.choices.values():
        yield from _help_texts(sub)


def test_cited_regex():
  assert cited("SPEC 14, SPEC 4.2 Parts 1, 2 and 3") == {"14", "4.2"}
  assert cited("(SPEC 4.2/4.3)") == {"4.2", "4.3"}
  assert cited("SPEC 2-4 and SPEC 10") == {"2", "3", "4", "10"}
  assert cited("SPEC.md, SPECS 3") == set()


def test_spec_has_every_section():
  have = sections()
  assert {str(n) for n in range(1, 16)} <= have
  assert {"4.1", "4.2", "4.3", "4.4"} <= have


def _missing(text: str, have) -> list:
  return sorted(cited(text) - have)


@pytest.mark.parametrize("package", PACKAGES)
def test_source_citations_resolve(package):
  have, bad = sections(), {}
  files = sorted((ROOT / package).rglob("*.py"))
  assert files
  for path in files:
    missing = _missing(path.read_text(), have)
    if missing:
      bad[str(path.relative_to(ROOT))] = missing
  assert not bad, f"cite SPEC sections docs/spec.md lacks: {bad}"


def test_readme_citations_resolve():
  text = (ROOT / "README.md").read_text()
  assert cited(text)
  assert not _missing(text, sections())


def test_cli_help_citations_resolve():
  have, seen = sections(), set()
  for name, _, _ in cli.COMMANDS:
    for text in _help_texts(cli.build([name])):
      assert not _missing(text, have), (name, _missing(text, have))
      seen |= cited(text)
  assert "14" in seen  # the help texts were rendered with their options


def test_docs_link_inside_the_repo():
  """Relative links in docs/*.md, README.md and BENCHMARKS.md point at files that exist."""
  pages = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
  bad = []
  for page in pages:
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text()):
      if "://" in target or target.startswith("mailto:"):
        continue
      if not (page.parent / target).exists():
        bad.append(f"{page.relative_to(ROOT)} -> {target}")
  assert not bad, bad
